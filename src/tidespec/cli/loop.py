"""`tidespec cycle`, `tidespec ingest`, `tidespec promote`, `tidespec rollback`: the loop by hand."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import typer

from .common import PARAMS, ROOT, app, console, tracking_uri, ws_of

log = logging.getLogger(__name__)


@app.command()
def cycle(root: Path = ROOT, params: Path = PARAMS, snapshot_rev: str = ""):
    """Run the Prefect flow tide_cycle once, in this process (needs PREFECT_API_URL and
    MLFLOW_TRACKING_URI); the flow comes from the project's flows/cycle.py, as a worker loads it."""
    from ..adapters.orchestrate import load_flow
    from ..config import load_params
    from ..train.entry import preflight
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        raise typer.BadParameter("set MLFLOW_TRACKING_URI (eval $(tidespec services up))")
    preflight(load_params(params).train)
    tide_cycle = load_flow("tide_cycle")
    res = tide_cycle(root=str(root.resolve()), params_path=str(params), snapshot_rev=snapshot_rev, trigger="cli")
    if res.get("skipped"):
        console.print(f"cycle skipped, champion untouched: {res['skipped']}")
        return
    console.print_json(json.dumps(res["register"]))

@app.command()
def ingest(root: Path = ROOT, params: Path = PARAMS,
           publish: bool = typer.Option(True, help="seal → dvc add + push + the tidespec.capture.threshold event")):
    """Production traffic → snapshots: read new SageMaker Data Capture objects (ingest.sources, else the
    deploy profiles' capture prefixes), rehydrate the target's hidden states from their text, write them
    through the capture writer (the `tide_capture` flow, run here once). Exactly once (ledger + event ids)."""
    from ..adapters.orchestrate import load_flow
    res = load_flow("tide_capture")(root=str(root.resolve()), params_path=str(params), publish=publish)
    console.print_json(json.dumps(res, default=str))

@app.command()
def promote(version: str, reason: str = typer.Option(..., help="why (recorded on the version and its run)"),
            workload: str = typer.Option("", help="make it this workload class's own champion "
                                                  "(alias champion-<class>)"),
            root: Path = ROOT, params: Path = PARAMS):
    """Move the `champion` alias (--workload: `champion-<class>`) to VERSION by hand (a version that
    failed the losslessness check is refused), then deploy it locally (data/drafts/champion, a class's
    under data/drafts/classes/<class>). Needs MLFLOW_TRACKING_URI."""
    _decide(root, params, lambda reg, uri, tid: reg.promote(uri, tid, version, reason, workload=workload))

@app.command()
def rollback(reason: str = typer.Option("", help="why (recorded with the decision)"),
             workload: str = typer.Option("", help="roll back this workload class's own champion (its first: to "
                                                   "the generalist)"),
             root: Path = ROOT, params: Path = PARAMS):
    """Move `champion` (--workload: `champion-<class>`) back to the previous champion, then deploy it
    locally. Needs MLFLOW_TRACKING_URI."""
    _decide(root, params, lambda reg, uri, tid: reg.rollback(uri, tid, reason, workload=workload))

def _decide(root: Path, params: Path, act) -> None:
    from ..adapters import registry
    from ..config import load_params
    from ..models.hf_files import target_id
    from ..steps.cycle import step_deploy
    uri = tracking_uri()
    p = load_params(params)
    tid = target_id(p)
    d = act(registry, uri, tid)
    dep = step_deploy(ws_of(root), uri, tid, p)
    console.print(f"champion v{d.version} (was v{d.previous_champion}): {d.reason}; deployed v{dep['version']} "
                  f"to {dep['path']}", highlight=False)
