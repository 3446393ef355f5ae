"""The canary rollout's step, as `tidespec rollout status|decide` and the `tide-rollout` deployment
call it: the registry decision (`adapters.registry.rollout.decide`, over `deploy.canary_windows`
windows), then, when the canary was promoted, the local deploy a promotion gets
(`steps.cycle.step_deploy`: data/drafts/champion, a running server told, deploy.sagemaker.on_promote)."""
from __future__ import annotations

import logging

from ..adapters.registry import rollout
from ..config import Params
from ..workspace import Workspace
from .cycle import step_deploy

log = logging.getLogger(__name__)


def step_rollout(ws: Workspace, params: Params, tracking_uri: str, target_id: str, act: bool = True) -> dict:
    """The decision on the canary (`rollout.decide`; `act` False: what it would decide, the registry
    untouched) as `Rollout.summary()`, plus `deploy` (`step_deploy`'s result) after a promotion. Raises
    as `decide` and `step_deploy` do."""
    r = rollout.decide(tracking_uri, target_id, params.deploy.canary_windows, act=act,
                       max_wait_s=params.deploy.canary_max_wait_s)
    out = r.summary()
    if r.acted:
        log.warning("rollout: %s: %s", "promoted" if r.verdict == rollout.PROMOTE else "rolled back", r.reason)
    if r.acted and r.verdict == rollout.PROMOTE:
        out["deploy"] = step_deploy(ws, tracking_uri, target_id, params)
    return out
