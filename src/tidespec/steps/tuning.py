"""The speculative window each deploy profile gets: pure maths over per-position acceptance and the
profile's step costs (no AWS, no I/O). The register step tunes it from the evaluate step's holdout
replay (`tuned_k.<profile>` on the model version); once an engine serving the version has measured
its own per-position acceptance on live traffic (`backends.live.report_live`: vLLM's counters), it is
tuned again from that (`live_tuned_k.<profile>`, which then wins: `adapters.registry.tuned_k`). The
local deploy writes it to version.json, and `adapters.sagemaker_deploy` applies it to the endpoint's
SGLang / vLLM settings.
"""
from __future__ import annotations

from ..config import Params
from ..config.sagemaker import EndpointProfile
from ..engine.stats import per_position, tau_by_k


def tuned_window(profile: EndpointProfile, per_pos: list[float], min_speedup: float) -> dict:
    """The goodput-optimal number of speculative steps for one endpoint profile, from the holdout's
    per-position acceptance (`accepted_per_pos/{i}` of a chain replay at K) and the profile's step
    cost: predicted speed-up(k) = τ(k) / (1 + verify_cost_per_token·k + draft_cost·k) (Leviathan et
    al. 2023, arXiv 2211.17192 §3.4), k = 1..K. Returns {"k": best k, or 0 (speculation off) when no k
    reaches `min_speedup`, "predicted_speedup": at that k (1.0 when off), "tau_k": [τ(0..K)]}."""
    taus = tau_by_k(per_pos)
    speed = [taus[k] / (1 + (profile.verify_cost_per_token + profile.draft_cost) * k) for k in range(len(taus))]
    k = max(range(1, len(taus)), key=lambda i: speed[i], default=0)
    if k == 0 or speed[k] < min_speedup:
        return {"k": 0, "predicted_speedup": 1.0, "tau_k": taus}
    return {"k": k, "predicted_speedup": speed[k], "tau_k": taus}


LIVE_MIN_DRAFTS = 100  # live per-position acceptance retunes a window only from this many drafts on


def live_windows(sm, per_pos: list[float], num_drafts: int) -> dict[str, dict]:
    """Per deploy profile of `sm` (`SageMakerDeployParams`, or None → {}), `tuned_window` from
    per-position acceptance measured live (`per_pos[i]` = accepted at position i / drafts, vLLM's
    `spec_decode_num_accepted_tokens_per_pos` over `_num_drafts`) once `num_drafts` ≥
    LIVE_MIN_DRAFTS ({} before). Positions beyond the served k were not measured, so the window
    never grows past it (τ(k) is known for k ≤ len(per_pos) only)."""
    if sm is None or num_drafts < LIVE_MIN_DRAFTS or not per_pos:
        return {}
    return {name: tuned_window(prof, list(per_pos), sm.min_speedup) for name, prof in sorted(sm.profiles.items())}


def tune_windows(params: Params, metrics: dict) -> dict[str, dict]:
    """Per deploy profile, the goodput-optimal number of speculative steps for the candidate on this
    holdout (`tuned_window`: τ(k) from the replay's per-position acceptance, the profile's step
    cost), or k = 0 (speculation off) when no k beats `deploy.sagemaker.min_speedup`.
    {} without deploy.sagemaker."""
    sm = params.deploy.sagemaker
    if sm is None:
        return {}
    per_pos = per_position(metrics)
    return {name: tuned_window(prof, per_pos, sm.min_speedup) for name, prof in sorted(sm.profiles.items())}
