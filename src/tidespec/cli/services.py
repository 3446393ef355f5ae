"""`tidespec services up|down|status`: the local Prefect (server + worker), MLflow and moto servers."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import typer
from rich.console import Console

from .common import console, services_app

log = logging.getLogger(__name__)


@services_app.command("up")
def services_up(state: Path = typer.Option(Path(".tidespec/services")),
                moto: bool = typer.Option(False, help="also a moto server (S3 + SageMaker API emulator)"),
                pool: list[str] = typer.Option([], help="also a worker on this work pool (repeatable), e.g. "
                                                        "tidespec-train for train.work_pool")):
    """Start Prefect + a process worker (pool tidespec) + MLflow (and moto) on 127.0.0.1, create
    the work pools ./prefect.yaml names; prints the client env to export. Idempotent."""
    from ..adapters import orchestrate, services
    svc = services.up(state, which=services.NAMES + (("moto",) if moto else ()), pools=tuple(pool))
    missing = None  # no prefect.yaml here: what to deploy is not known
    if Path("prefect.yaml").exists():
        orchestrate.ensure_pools(svc["prefect"].url, orchestrate.yaml_pools(Path(".")))
        missing = orchestrate.missing_deployments(svc["prefect"].url, Path("."))
    for k, v in services.env_for(svc).items():
        console.print(f"export {k}={v}")
    workers = ", ".join(f"{n} (pid {s.pid})" for n, s in svc.items() if n.startswith("worker"))
    if missing == []:
        nxt = "prefect.yaml's deployments are on the server"
    elif missing:
        nxt = f"next: prefect --no-prompt deploy --all (with the env above) for {', '.join(missing)}"
    else:  # no prefect.yaml here, or one that declares no deployment
        nxt = "next: prefect --no-prompt deploy --all in the project root (with the env above)"
    Console(stderr=True, soft_wrap=True).print(f"workers: {workers}; {nxt}", markup=False, highlight=False)

@services_app.command("down")
def services_down(state: Path = typer.Option(Path(".tidespec/services"))):
    """Stop the servers recorded under --state (only the pids it started)."""
    from ..adapters import services
    console.print(f"stopped: {services.down(state)}")

@services_app.command("status")
def services_status(state: Path = typer.Option(Path(".tidespec/services"))):
    """Recorded servers: url, pid, alive, healthy (JSON)."""
    from ..adapters import services
    console.print_json(json.dumps(services.status(state), default=str))
