"""Prefect flow `tide_cycle`: curate → train → evaluate → register → class drafts → deploy (thin: logic in
`tidespec.steps.cycle` and `tidespec.steps.classes`).

Deployed by prefect.yaml (`tide-cycle`, entrypoint `flows/cycle.py:tide_cycle`: interval schedule +
trigger on `tidespec.capture.threshold`), and by `tidespec fleet deploy` for a worker on another
machine (the same entry, run from the worker's own workspace: `tidespec.adapters.fleet_deploy`);
run in-process by `tidespec cycle`, the demos and `bench shift` through
`tidespec.adapters.orchestrate.load_flow` (the same entrypoint).
Params are read once per run: the flow freezes them (`cycle.freeze_params`, data/work/params-<sha>.yaml)
and every task loads that file, so an edit of params.yaml during the run changes nothing in it.
Tasks pass paths/URIs only. Retries only for transient failures (a service unreachable:
`orchestrate.retry_if_transient`); bad data fails at once and leaves the champion serving.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from prefect import flow, get_run_logger, task

from tidespec.adapters import orchestrate
from tidespec.config import load_params
from tidespec.workspace import Workspace

# the steps (torch, MLflow) are imported where a task runs them: `prefect deploy` loads this file for
# the flow's parameters only

TRANSIENT = {"retries": 2, "retry_delay_seconds": 5, "retry_condition_fn": orchestrate.retry_if_transient}


def _ws(root: str) -> Workspace:
    return Workspace(Path(root).resolve())


@task(name="curate")
def curate(root: str, params_path: str, target_id: str) -> dict:
    from tidespec.steps import cycle
    return cycle.step_curate(_ws(root), load_params(params_path), target_id)


@task(name="champion", **TRANSIENT)
def fetch_champion(root: str, tracking_uri: str, target_id: str) -> str | None:
    from tidespec.adapters import registry
    got = registry.download_champion(tracking_uri, target_id, _ws(root).work / "champion")
    return str(got) if got else None


@task(name="train", **TRANSIENT)
def train(root: str, params_path: str, curated: str, init: str | None) -> dict:
    from tidespec.steps import cycle
    ws = _ws(root)
    return cycle.train_candidate(ws, load_params(params_path), Path(curated), Path(init) if init else None,
                                 ws.candidate, params_path=Path(params_path))


@task(name="evaluate")
def evaluate(root: str, params_path: str, champion: str | None) -> dict:
    from tidespec.steps.evaluate import step_evaluate
    ws = _ws(root)
    return step_evaluate(ws, load_params(params_path), ws.candidate, Path(champion) if champion else None,
                         ws.eval_prompts, ws.eval_report)


@task(name="register", **TRANSIENT)
def register(params_path: str, target_id: str, candidate: str, report: dict, train_metrics: dict,
             tracking_uri: str, curated: str, snapshot_rev: str, workload_mix: dict,
             drift_jsd: float | None = None, trigger: str = "manual") -> dict:
    from tidespec.steps import cycle
    from tidespec.steps.register import step_register
    return step_register(load_params(params_path), target_id, Path(candidate), report, train_metrics,
                         tracking_uri, cycle.lineage(Path(curated), snapshot_rev), workload_mix, drift_jsd, trigger)


@task(name="class drafts")
def class_drafts(root: str, params_path: str, target_id: str, tracking_uri: str, snapshot_rev: str,
                 trigger: str) -> dict:
    from tidespec.steps.classes import class_cycles
    return class_cycles(_ws(root), load_params(params_path), target_id, tracking_uri, snapshot_rev=snapshot_rev,
                        trigger=trigger, params_path=Path(params_path))


@task(name="deploy", **TRANSIENT)
def deploy(root: str, tracking_uri: str, target_id: str, params_path: str = "params.yaml") -> dict:
    from tidespec.steps import cycle
    return cycle.step_deploy(_ws(root), tracking_uri, target_id, load_params(params_path))


@flow(name="tide_cycle", log_prints=True)
def tide_cycle(root: str = ".", params_path: str = "params.yaml", target_id: str = "",
               snapshot_rev: str = "", tracking_uri: str | None = None, trigger: str = "manual",
               force: bool = False) -> dict:
    """One adaptation cycle over the snapshots under `root`/data/snapshots/<target_id> (with
    `curate.fleet`, over every replica's, listed from the DVC remote: docs/fleet.md).

    trigger: why it runs (manual, schedule, tokens, drift: from the event). A cycle with no sealed
    snapshot newer than the last completed cycle's is skipped unless `force`. `params_path` is read
    once, here: the tasks get its frozen copy."""
    from tidespec.models.hf_files import target_id as target_id_of
    from tidespec.steps import cycle
    log = get_run_logger()
    tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not tracking_uri:
        raise ValueError("no MLflow tracking URI: pass tracking_uri or set MLFLOW_TRACKING_URI "
                         "(tidespec services up prints it)")
    ws = _ws(root)
    params, frozen = cycle.freeze_params(ws, params_path)  # read once: every task below loads this copy
    frozen = str(frozen)
    log.info("params %s (sha %s) frozen as %s", params_path, params.sha(), frozen)
    if not target_id:
        target_id = target_id_of(params)
    if not force and (why := cycle.nothing_new(ws, target_id, params)):
        log.info("cycle skipped, champion untouched: %s", why)
        return {"skipped": why}
    cur = curate(root, frozen, target_id)
    drift = "n/a (first curated set)" if cur["drift_jsd"] is None else f"{cur['drift_jsd']:.3f} bits (JSD)"
    log.info("trigger %s: curated %s train / %s val / %s holdout records, drift vs previous set: %s", trigger,
             cur["num_train"], cur["num_val"], cur["num_holdout"], drift)
    champ = fetch_champion(root, tracking_uri, target_id)
    tm = train(root, frozen, cur["curated"], champ)
    if tm.get("skipped"):
        log.warning("cycle skipped, champion untouched: %s", tm["skipped"])
        return {"curate": cur, "skipped": tm["skipped"]}
    rep = evaluate(root, frozen, champ)
    mix = json.loads(Path(cur["curated"]).read_text()).get("workload_mix", {})
    dec = register(frozen, target_id, str(ws.candidate), rep, tm, tracking_uri, cur["curated"], snapshot_rev,
                   mix, cur["drift_jsd"], trigger)
    log.info("register: version %s promoted=%s (%s)", dec["version"], dec["promoted"], dec["reason"])
    classes = (class_drafts(root, frozen, target_id, tracking_uri, snapshot_rev, trigger)
               if params.train.class_drafts else {})
    dep = deploy(root, tracking_uri, target_id, frozen)
    cycle.mark_done(ws, Path(cur["curated"]), params)  # curate.fleet: the fleet threshold counts from here
    return {"curate": cur, "train": {k: v for k, v in tm.items() if not isinstance(v, list)}, "evaluate": rep,
            "register": dec, "classes": classes, "deploy": dep}
