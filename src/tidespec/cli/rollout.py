"""`tidespec rollout status|decide`: the canary rollout's decision by hand (`steps.rollout`)."""
from __future__ import annotations

import json
from pathlib import Path

from .common import PARAMS, ROOT, console, rollout_app, tracking_uri, ws_of


@rollout_app.command("status")
def status(root: Path = ROOT, params: Path = PARAMS):
    """The canary against the champion on the same windows since it became canary (τ ± SE and drafts per
    side per window) and what a decision would do now; moves nothing. Needs MLFLOW_TRACKING_URI."""
    _rollout(root, params, act=False)


@rollout_app.command("decide")
def decide(root: Path = ROOT, params: Path = PARAMS):
    """Decide now, as the tide-rollout deployment does on its interval: promote the canary (then deploy it
    locally, as `tidespec promote`), roll it back, or wait. Needs MLFLOW_TRACKING_URI."""
    _rollout(root, params, act=True)


def _rollout(root: Path, params: Path, act: bool) -> None:
    from ..config import load_params
    from ..models.hf_files import target_id
    from ..steps.rollout import step_rollout
    p = load_params(params)
    console.print_json(json.dumps(step_rollout(ws_of(root), p, tracking_uri(), target_id(p), act=act), default=str))
