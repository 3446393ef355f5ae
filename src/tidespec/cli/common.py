"""What every command module shares: the `tidespec` typer app and its command groups, the console,
the --params / --root options, and the workspace / tracking-URI lookups."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import typer
from rich.console import Console

from ..bench.cli import bench_app

app = typer.Typer(help="tidespec: self-improving speculative decoding (capture → curate → train → "
                       "evaluate → register → deploy).", no_args_is_help=True)
services_app = typer.Typer(help="Start/stop the local Prefect and MLflow servers (and moto with --moto).")
snap_app = typer.Typer(help="Captured snapshots: list, seal what is captured, pull one back from the DVC remote.")
stage_app = typer.Typer(help="DVC stages (dvc.yaml): curate, train, evaluate, register.")
deploy_app = typer.Typer(help="Deploy the champion draft to serving endpoints (SageMaker blue/green).")
rollout_app = typer.Typer(help="A canary rollout (deploy.rollout: canary): the canary against the champion on the "
                               "same traffic, and the decision.")
fleet_app = typer.Typer(help="The loop across machines: the cycle deployed for workers that share no file.")
app.add_typer(services_app, name="services")
app.add_typer(snap_app, name="snapshots")
app.add_typer(stage_app, name="stage")
app.add_typer(bench_app, name="bench")
app.add_typer(deploy_app, name="deploy")
app.add_typer(rollout_app, name="rollout")
app.add_typer(fleet_app, name="fleet")
console = Console()
PARAMS = typer.Option(Path("params.yaml"), "--params", help="params.yaml")
ROOT = typer.Option(Path("."), "--root", help="workspace root (data/ lives here)")


def ws_of(root: Path):
    """The `Workspace` at `root` (resolved)."""
    from ..workspace import Workspace
    return Workspace(root.resolve())


def tracking_uri() -> str:
    """$MLFLOW_TRACKING_URI; typer.BadParameter naming the fix when unset."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise typer.BadParameter("set MLFLOW_TRACKING_URI (eval $(tidespec services up))")
    return uri


LOG_LEVEL_ENV = "TIDESPEC_LOG_LEVEL"


def log_to_stderr() -> None:
    """Show tidespec's own log records (swaps, rollbacks, pins, live-acceptance warnings) on stderr
    at $TIDESPEC_LOG_LEVEL (default INFO; DEBUG, WARNING, ...): Python shows only warnings from a
    logger nobody configured, and uvicorn configures its own loggers only. Idempotent; records do
    not also reach the root logger (no duplicates under a host that configures it). Raises
    ValueError naming the variable for an unknown level."""
    level = os.environ.get(LOG_LEVEL_ENV, "INFO").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"{LOG_LEVEL_ENV}={level!r}: one of DEBUG, INFO, WARNING, ERROR")
    log = logging.getLogger("tidespec")
    log.setLevel(level)
    if not any(getattr(h, "_tidespec", False) for h in log.handlers):
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        h._tidespec = True
        log.addHandler(h)
    log.propagate = False
