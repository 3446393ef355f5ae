"""The cycle's register step: the candidate into the MLflow registry with its evaluation, lineage
and per-profile windows, the promotion gate applied (`adapters.registry.promote_if_better`)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from ..adapters import registry
from ..assets import sha256_file
from ..config import Params
from ..engine.stats import per_position, tau_by_k
from ..engine.suffix_tree import CORPUS_FILE, corpus_info
from . import plots
from .tuning import tune_windows

log = logging.getLogger(__name__)


def first_token_acceptance(m: dict) -> dict[str, list[float]]:
    """{class: [a₁, chains]} from evaluate's metrics of a draft: "" = `accepted_per_pos/0` over
    `num_drafts`, each class its `first_token_acceptance/<class>` over `num_drafts/<class>` (what a serving
    engine's draft health compares live traffic with, `engine.health`)."""
    out = {"": [float(m["accepted_per_pos/0"]), float(m["num_drafts"])]} if "accepted_per_pos/0" in m else {}
    per = {k.split("/", 1)[1]: float(v) for k, v in m.items() if k.startswith("first_token_acceptance/")}
    return out | {w: [a, float(m.get(f"num_drafts/{w}", 0.0))] for w, a in per.items()}


def step_register(params: Params, target_id: str, candidate: Path, report: dict, train_metrics: dict,
                  tracking_uri: str, data: dict[str, str], workload_mix: dict | None = None,
                  drift_jsd: float | None = None, trigger: str = "manual", workload: str = "") -> dict:
    """Log the candidate as a model version (alias challenger) with its metrics, training curves and
    lineage tags, apply the promotion rule (registry.promote_if_better, against the champion version
    evaluate measured: `report["champion_version"]`), then log plots (τ over cycles, per-position
    acceptance, loss; best effort: a failure there is logged, not raised). Idempotent: a retry finds
    the version it already logged (tag `draft_sha256` + snapshot_rev) and returns its decision
    instead of registering the same draft twice. `data`: `lineage()` of the curated set (tags
    snapshot_rev, snapshot_revs, holdout_split: the gate's holdout); `drift_jsd`: curate's drift
    (bits) vs the previous curated set;
    `trigger`: what started the cycle (tag); `workload`: a class draft's (tag `workload`; the gate of
    that class's champion, `champion-<class>`, against what serves the class now: its champion, with
    `evaluate.min_relative_gain`, or for its first the generalist, with `evaluate.class_first_gain`).
    With `deploy.rollout: canary` a generalist that passes the gate goes to the `canary` alias (result
    `canary` True, `promoted` False) unless it is the first champion; a class draft is promoted directly.
    Every version carries the τ(k) its replay measured (tag `tau_k`, JSON [τ(0..K)]: the reference of
    the live-acceptance checks, SageMaker's alarm among them). With deploy.sagemaker, each profile's
    tuned window goes on the version (tags `tuned_k.<profile>`, metrics `tau_k/<k>`,
    `predicted_speedup/<profile>`; `tune_windows`) and into the result's `tuned_k`. Evaluate's
    forgetting on the retained holdout (metrics `retained_tau/<class>`, `retained_forgetting/<class>`)
    gates the classes the candidate would serve when `evaluate.max_forgetting` is set
    (`_served_forgetting`). Raises ValueError for empty lineage."""
    if not data.get("snapshot_rev") or not json.loads(data.get("snapshot_revs") or "{}"):
        raise ValueError("no data lineage for this candidate: pass lineage(curated) (snapshot revs of its curated set)")
    cand, champ = report["candidate"], report.get("champion")
    key = {"draft_sha256": sha256_file(Path(candidate) / "model.safetensors"), "snapshot_rev": data["snapshot_rev"]}
    prior = registry.find_version(tracking_uri, target_id, key, workload)
    if prior is not None and prior.tags.get("decision"):
        return {"run_id": prior.run_id, "version": prior.version, "promoted": prior.tags["decision"] == "promoted",
                "canary": prior.tags["decision"] == "canary",
                "reason": prior.tags.get("decision_reason", ""), "previous_champion": None,
                "tuned_k": registry.tuned_k(prior.tags)}
    if prior is not None:
        run_id, version = prior.run_id, prior.version
    else:
        metrics = {k: float(v) for k, v in cand.items() if isinstance(v, (int, float))}
        metrics["baseline_tokens_per_s"] = report["baseline"]["tokens_per_s"]
        if champ:
            metrics["baseline_acceptance_length"] = champ["acceptance_length"]
        metrics |= {k: float(v) for k, v in train_metrics.items() if isinstance(v, (int, float))}
        if drift_jsd is not None:
            metrics["drift_jsd"] = float(drift_jsd)
        losses = list(train_metrics.get("train/loss", []))
        windows = tune_windows(params, cand)
        if windows:  # τ(k) on the holdout and each endpoint's window (deploy sagemaker applies it)
            metrics |= {f"tau_k/{k}": t for k, t in enumerate(next(iter(windows.values()))["tau_k"])}
            metrics |= {f"predicted_speedup/{p}": w["predicted_speedup"] for p, w in windows.items()}
        corpus = Path(candidate) / CORPUS_FILE
        if corpus.exists():  # the global suffix tree deployed with this draft: lineage + size
            tags = {"suffix_corpus_sha256": sha256_file(corpus)}
            metrics |= {f"suffix_corpus/{k}": float(v) for k, v in corpus_info(corpus).items()}
        else:
            tags = {}
        tags |= {**key, "snapshot_revs": data["snapshot_revs"], "params_sha": params.sha(), "trigger": trigger,
                "holdout_split": data.get("holdout_split", "random"),
                **({"workload": workload} if workload else {}),
                **{f"tuned_k.{p}": str(w["k"]) for p, w in windows.items()},
                **({"tau_k": json.dumps(tau_by_k(per_position(cand)))} if per_position(cand) else {}),
                "workload_mix": json.dumps(workload_mix or {}), "lossless": str(report["lossless"]),
                "num_holdout_prompts": str(report.get("num_prompts", "")),
                registry.FIRST_TOKEN_TAG: json.dumps(first_token_acceptance(cand))}
        run_id, version = registry.log_candidate(tracking_uri, target_id, candidate, params.model_dump(mode="json"),
                                                 metrics, tags, step_metrics={"train/loss": losses})
    own = registry.champion(tracking_uri, target_id, workload) if workload else None
    current = own or registry.champion(tracking_uri, target_id)  # what serves the class (or all) now
    champ_tau = champ["acceptance_length"] if (champ and current) else None
    gain = params.evaluate.class_first_gain if workload and own is None else params.evaluate.min_relative_gain
    d = registry.promote_if_better(tracking_uri, target_id, version, cand["acceptance_length"], champ_tau,
                                   gain, bool(report["lossless"]),
                                   evaluated_champion=report.get("champion_version") if champ else None,
                                   workload=workload, canary=params.deploy.rollout == "canary" and not workload,
                                   forgetting=_served_forgetting(tracking_uri, target_id, report, workload,
                                                                 params.evaluate.max_forgetting is not None),
                                   max_forgetting=params.evaluate.max_forgetting)
    try:  # plots are a view: failing to draw or upload them does not undo or block the decision
        losses = list(train_metrics.get("train/loss", []))
        registry.log_figures(tracking_uri, run_id, _figures(tracking_uri, target_id, report, losses))
    except Exception as e:  # noqa: BLE001 - figures are best effort: the version stands without them
        log.warning("plots not logged for run %s: %s", run_id, e)
    unread = report.get("retained_error")
    reason = d.reason + (f"; forgetting not checked ({unread})" if unread else "")
    return {"run_id": run_id, "version": version, "promoted": d.promoted, "canary": d.canary, "reason": reason,
            "previous_champion": d.previous_champion,
            "tuned_k": {p: w["k"] for p, w in tune_windows(params, cand).items()}}


def _served_forgetting(tracking_uri: str, target_id: str, report: dict, workload: str,
                       gated: bool = True) -> dict[str, float]:
    """{class: forgetting} of evaluate's retained holdout (`steps.evaluate`) over the classes the
    candidate would serve: a class draft its own class; the generalist every class without a champion
    of its own (a label that is no class name never has one). {} when not `gated` (no registry call)."""
    measured = {w: r["forgetting"] for w, r in report.get("retained", {}).items() if r.get("forgetting") is not None}
    if not gated:
        return {}
    if workload:
        return {w: f for w, f in measured.items() if w == workload}
    return {w: f for w, f in measured.items()
            if not registry.CLASS_NAME.match(w) or registry.champion(tracking_uri, target_id, w) is None}


def _figures(tracking_uri: str, target_id: str, report: dict, losses: list[float]) -> dict:
    def per_pos(m):
        return per_position(m) if m else None
    figs = {
        "tau_over_cycles": plots.tau_over_cycles(registry.cycle_history(tracking_uri, target_id)),
        "per_position_acceptance": plots.per_position(per_pos(report["candidate"]), per_pos(report.get("champion"))),
    }
    if losses:
        figs["train_loss"] = plots.loss(losses)
    return figs
