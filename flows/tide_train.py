"""Prefect flow `tide_train`: the train step on its own work pool (deployment tide-train).

tide_cycle starts it with `run_deployment` when `train.work_pool` is set; it writes the candidate
and its train_metrics.json under `out` (a path both pools see). Thin: logic in tidespec.cycle.
"""
from __future__ import annotations

from pathlib import Path

from prefect import flow

from tidespec import cycle
from tidespec.config import load_params


@flow(name="tide_train", log_prints=True)
def tide_train(curated: str, out: str, init: str | None = None, root: str = ".",
               params_path: str = "params.yaml") -> dict:
    """Train a candidate draft from the curated index `curated` into `out` (warm start: `init`)."""
    ws = cycle.Workspace(Path(root).resolve())
    m = cycle.step_train(ws, load_params(params_path), Path(curated), Path(init) if init else None, Path(out))
    return {k: v for k, v in m.items() if not isinstance(v, list)}
