"""The speculative window each deploy profile gets: pure maths over the evaluate step's holdout
metrics and the profile's step costs (no AWS, no I/O). The register step records the result on the
model version (`tuned_k.<profile>`), the local deploy writes it to version.json, and
`adapters.sagemaker_deploy` applies it to the endpoint's SGLang / vLLM settings.
"""
from __future__ import annotations

from .config import Params
from .engine.stats import tau_by_k
from .sagemaker_config import EndpointProfile


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


def tune_windows(params: Params, metrics: dict) -> dict[str, dict]:
    """Per deploy profile, the goodput-optimal number of speculative steps for the candidate on this
    holdout (`tuned_window`: τ(k) from the replay's per-position acceptance, the profile's step
    cost), or k = 0 (speculation off) when no k beats `deploy.sagemaker.min_speedup`.
    {} without deploy.sagemaker."""
    sm = params.deploy.sagemaker
    if sm is None:
        return {}
    n = sum(k.startswith("accepted_per_pos/") for k in metrics)
    per_pos = [metrics[f"accepted_per_pos/{i}"] for i in range(n)]
    return {name: tuned_window(prof, per_pos, sm.min_speedup) for name, prof in sorted(sm.profiles.items())}
