"""Prefect flow `tide_cycle`: curate → train → evaluate → register → deploy (thin: logic in tidespec.cycle).

Tasks pass paths/URIs only. Retries only where failure is transient (MLflow unreachable);
bad data fails fast and leaves the champion serving.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from prefect import flow, get_run_logger, task

from tidespec import cycle, registry
from tidespec.config import load_params


def _ws(root: str) -> cycle.Workspace:
    return cycle.Workspace(Path(root).resolve())


@task(name="curate")
def curate(root: str, params_path: str, target_id: str) -> dict:
    return cycle.step_curate(_ws(root), load_params(params_path), target_id)


@task(name="champion", retries=2, retry_delay_seconds=5)
def fetch_champion(root: str, tracking_uri: str, target_id: str) -> str | None:
    dest = _ws(root).work / "champion"
    got = registry.download_champion(tracking_uri, target_id, dest)
    return str(got) if got else None


@task(name="train")
def train(root: str, params_path: str, curated: str, init: str | None) -> dict:
    ws = _ws(root)
    return cycle.step_train(ws, load_params(params_path), Path(curated), Path(init) if init else None, ws.candidate)


@task(name="evaluate")
def evaluate(root: str, params_path: str, champion: str | None) -> dict:
    ws = _ws(root)
    return cycle.step_evaluate(ws, load_params(params_path), ws.candidate, Path(champion) if champion else None,
                               ws.eval_prompts, ws.eval_report)


@task(name="register", retries=2, retry_delay_seconds=5)
def register(params_path: str, target_id: str, candidate: str, report: dict, train_metrics: dict,
             tracking_uri: str, snapshot_rev: str, workload_mix: dict, drift_jsd: float | None = None) -> dict:
    return cycle.step_register(load_params(params_path), target_id, Path(candidate), report, train_metrics,
                               tracking_uri, snapshot_rev, workload_mix, drift_jsd)


@task(name="deploy", retries=2, retry_delay_seconds=5)
def deploy(root: str, tracking_uri: str, target_id: str) -> dict:
    return cycle.step_deploy(_ws(root), tracking_uri, target_id)


@flow(name="tide_cycle", log_prints=True)
def tide_cycle(root: str = ".", params_path: str = "params.yaml", target_id: str = "",
               snapshot_rev: str = "", tracking_uri: str | None = None) -> dict:
    """One adaptation cycle over the snapshots under `root`/data/snapshots/<target_id>."""
    log = get_run_logger()
    tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not tracking_uri:
        raise ValueError("no MLflow tracking URI: pass tracking_uri or set MLFLOW_TRACKING_URI "
                         "(tidespec services up prints it)")
    if not target_id:
        target_id = cycle.get_target(load_params(params_path))[0].target_id
    cur = curate(root, params_path, target_id)
    drift = "n/a (first curated set)" if cur["drift_jsd"] is None else f"{cur['drift_jsd']:.3f} bits (JSD)"
    log.info("curated %s train / %s val / %s holdout records, drift vs previous set: %s", cur["num_train"],
             cur["num_val"], cur["num_holdout"], drift)
    champ = fetch_champion(root, tracking_uri, target_id)
    tm = train(root, params_path, cur["curated"], champ)
    if tm.get("skipped"):
        log.warning("cycle skipped, champion untouched: %s", tm["skipped"])
        return {"curate": cur, "skipped": tm["skipped"]}
    rep = evaluate(root, params_path, champ)
    mix = json.loads(Path(cur["curated"]).read_text()).get("workload_mix", {})
    dec = register(params_path, target_id, str(_ws(root).candidate), rep, tm, tracking_uri, snapshot_rev, mix,
                   cur["drift_jsd"])
    log.info("register: version %s promoted=%s (%s)", dec["version"], dec["promoted"], dec["reason"])
    dep = deploy(root, tracking_uri, target_id)
    return {"curate": cur, "train": {k: v for k, v in tm.items() if k != "train/loss"}, "evaluate": rep,
            "register": dec, "deploy": dep}
