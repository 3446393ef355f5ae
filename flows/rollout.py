"""Prefect flow `tide_rollout`: the canary rollout's decision, on an interval (thin: logic in
`tidespec.steps.rollout` and `tidespec.adapters.registry.rollout`).

Deployed by prefect.yaml (`tide-rollout`, entrypoint `flows/rollout.py:tide_rollout`, interval
schedule). Without a `canary` alias in the registry a run does nothing; with one (`deploy.rollout:
canary`), it promotes the canary once its live τ is not worse than the stable replicas' on the same
windows, rolls it back when it is worse, or waits.
"""
from __future__ import annotations

import os
from pathlib import Path

from prefect import flow, get_run_logger

from tidespec.config import load_params
from tidespec.models.hf_files import target_id as target_id_of
from tidespec.workspace import Workspace


@flow(name="tide_rollout", log_prints=True)
def tide_rollout(root: str = ".", params_path: str = "params.yaml", target_id: str = "",
                 tracking_uri: str | None = None) -> dict:
    """One decision on the registry's canary of `target_id` (default: params' target)."""
    from tidespec.steps.rollout import step_rollout  # here, not at import: `prefect deploy` loads this file
    tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not tracking_uri:
        raise ValueError("no MLflow tracking URI: pass tracking_uri or set MLFLOW_TRACKING_URI "
                         "(tidespec services up prints it)")
    params = load_params(params_path)
    out = step_rollout(Workspace(Path(root).resolve()), params, tracking_uri, target_id or target_id_of(params))
    get_run_logger().info("rollout: %s (%s)", out["verdict"], out["reason"])
    return out
