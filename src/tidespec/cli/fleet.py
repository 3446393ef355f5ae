"""`tidespec fleet`: one view of the fleet — every replica seen in the registry for a target
(`adapters.registry.fleet`), as a table or as JSON."""
from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.table import Table

from .common import PARAMS, ROOT, app, console, tracking_uri, ws_of

SEALS_REMOTE, SEALS_LOGGED = "dvc remote", "replicas"  # where the last-seal column comes from


@app.command("fleet")
def fleet(root: Path = ROOT, params: Path = PARAMS,
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
    from ..models.load import target_id
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
