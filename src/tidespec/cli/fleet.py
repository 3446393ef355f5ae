"""`tidespec fleet`: the loop across machines (docs/fleet.md) — `status`, one view of the fleet (every
replica seen in the registry for a target, `adapters.registry.fleet`, as a table or as JSON), and
`deploy`, the cycle deployed for workers on other machines."""
from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.table import Table

from .common import PARAMS, ROOT, console, fleet_app, tracking_uri, ws_of

SEALS_REMOTE, SEALS_LOGGED = "dvc remote", "replicas"  # where the last-seal column comes from


@fleet_app.command("status")
def fleet_status(root: Path = ROOT, params: Path = PARAMS,
          target: str = typer.Option(None, "--target", help="target id (default: the target of --params)"),
          as_json: bool = typer.Option(False, "--json", help="JSON for machines instead of the table")):
    """Each replica serving the target, from what every replica logs to the registry each
    serve.live_stats_s: its version (canary or not), live τ on it, requests served, capture backlog
    (tokens captured not yet sealed), last seal (from the DVC remote's manifests when --root's repo
    has a default remote, else as the replica logged it) and the age of its last sample (stale after
    3 × serve.live_stats_s). Needs MLFLOW_TRACKING_URI."""
    from ..adapters.registry.fleet import STALE_ROUNDS
    from ..adapters.registry.fleet import fleet as replicas
    from ..config import load_params
    from ..models.hf_files import target_id
    uri = tracking_uri()
    p = load_params(params)
    tid = target or target_id(p)
    seals, source = remote_seals(ws_of(root).root, tid)
    rows = replicas(uri, tid, p.serve.live_stats_s, seals)
    if as_json:
        console.print_json(json.dumps({"target_id": tid, "stale_after_s": STALE_ROUNDS * p.serve.live_stats_s,
                                       "last_seal_from": source, "replicas": [r.as_dict() for r in rows]}))
        return
    console.print(fleet_table(rows, tid, source))


def remote_seals(repo: Path, tid: str) -> tuple[dict[str, float] | None, str]:
    """({replica id: its newest seal, s since the epoch} from the DVC remote's manifests, SEALS_REMOTE)
    when `repo` is a DVC repo with a default remote; (None, SEALS_LOGGED) otherwise. The remote's own
    errors (unreachable, denied) propagate."""
    if not (repo / ".dvc").is_dir():
        return None, SEALS_LOGGED
    from ..adapters.remote_snapshots import last_seals
    from ..adapters.versioning import VersioningError
    try:
        return last_seals(repo, tid), SEALS_REMOTE
    except VersioningError:  # a DVC repo without a default remote: no fleet index to read
        return None, SEALS_LOGGED


def fleet_table(rows, tid: str, source: str) -> Table:
    """The rich table of `adapters.registry.fleet.ReplicaRow`s: one row per replica."""
    t = Table("replica", "canary", "version", "live τ", "drafts", "requests", "backlog (tokens)",
              f"last seal ({source})", "last sample", "state", title=f"fleet of target {tid[:12]}")
    for r in rows:
        t.add_row(r.replica_id, "yes" if r.canary else "", f"v{r.version}", _or_dash(r.tau, "{:.3f}"), str(r.drafts),
                  _or_dash(r.requests), _or_dash(r.capture_backlog), r.last_seal or "—",
                  f"{r.last_sample} ({r.age_s:.0f} s ago)", "stale" if r.stale else "live")
    return t


def _or_dash(x, fmt: str = "{}") -> str:
    return "—" if x is None else fmt.format(x)



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
