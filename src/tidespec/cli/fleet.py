"""`tidespec fleet deploy`: the cycle deployed for workers on other machines (docs/fleet.md)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import typer

from .common import PARAMS, console, fleet_app


@fleet_app.command("deploy")
def fleet_deploy(remote: str = typer.Option(..., help="the fleet's DVC remote: s3://bucket/prefix, or an absolute "
                                                      "path every machine reaches"),
                 endpoint_url: str = typer.Option(None, help="S3 endpoint other than AWS's (moto, MinIO)"),
                 name: str = typer.Option("tide-cycle", help="deployment name (tide_cycle/NAME); also the workers' "
                                                             "directory: one per params.yaml, so one per target"),
                 pool: str = typer.Option("tidespec-fleet", help="the work pool the workers poll"),
                 worker_home: str = typer.Option(None, help="the workers' workspace root (default theirs: "
                                                            "$TIDESPEC_WORKER_HOME, else ~/.tidespec/worker)"),
                 params: Path = PARAMS):
    """Publish params.yaml and flows/ to the DVC remote, then deploy prefect.yaml's tide-cycle (schedule,
    trigger, concurrency) on POOL with a pull step that prepares each worker's own workspace from
    them. Run in the project root; needs PREFECT_API_URL."""
    from ..adapters import fleet_deploy as fd
    from ..adapters.orchestrate import project_root
    api = os.environ.get("PREFECT_API_URL")
    if not api:
        raise typer.BadParameter("set PREFECT_API_URL: the Prefect server every machine of the fleet reaches")
    out = fd.deploy_fleet(project_root(), api, remote, params, name=name, pool=pool, endpoint_url=endpoint_url,
                          home=worker_home)
    console.print_json(json.dumps(out))
    console.print(f"next, on each worker machine (the installed package, the target at target.source): "
                  f"PREFECT_API_URL=... MLFLOW_TRACKING_URI=... prefect worker start --pool {pool} --type process",
                  markup=False, highlight=False, soft_wrap=True)
