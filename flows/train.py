"""Prefect flow `tide_train`: the train step on its own work pool (deployment `tide-train`,
entrypoint `flows/train.py:tide_train`).

`tide_cycle` starts it with `run_deployment` when `train.work_pool` is set (params_path: the cycle's
frozen params); it trains here (the pool's worker) through the same `cycle.train_candidate` and
writes the candidate and its train_metrics.json under `out` (a path both pools see).
"""
from __future__ import annotations

from pathlib import Path

from prefect import flow

from tidespec.config import load_params
from tidespec.workspace import Workspace


@flow(name="tide_train", log_prints=True)
def tide_train(curated: str, out: str, init: str | None = None, root: str = ".",
               params_path: str = "params.yaml") -> dict:
    """Train a candidate draft from the curated index `curated` into `out` (warm start: `init`)."""
    from tidespec.steps import cycle  # here, not at import: `prefect deploy` loads this file for its parameters
    ws = Workspace(Path(root).resolve())
    m = cycle.train_candidate(ws, load_params(params_path), Path(curated), Path(init) if init else None, Path(out),
                              params_path=Path(params_path), here=True)
    return {k: v for k, v in m.items() if not isinstance(v, list)}
