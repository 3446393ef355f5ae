"""`tidespec snapshots list|seal|pull`: captured snapshots, local and on the DVC remote."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import typer

from .common import PARAMS, ROOT, console, snap_app, ws_of

log = logging.getLogger(__name__)


@snap_app.command("list")
def snapshots_list(root: Path = ROOT):
    """Sealed snapshots per target: local, or only on the DVC remote (retention); records, tokens, bytes/token."""
    from rich.table import Column, Table

    from ..capture.snapshots import load_snapshot
    ws = ws_of(root)
    t = Table("target", Column("snapshot", no_wrap=True, min_width=29), "where", "records", "tokens",
              "bytes/token", "sealed on")
    for tdir in sorted(p for p in ws.snapshots.glob("*") if p.is_dir()):
        sids = sorted({p.name.removesuffix(".dvc") for p in tdir.iterdir() if not p.name.startswith(".")})
        for sid in sids:
            d = tdir / sid
            if (d / "snapshot.json").exists():
                i = load_snapshot(d)
                where = "local + remote" if d.with_name(sid + ".dvc").exists() else "local only"
                t.add_row(tdir.name[:12], sid, where, str(i.num_records), str(i.num_tokens),
                          f"{i.bytes_per_token:.0f}", i.reason)
            elif d.with_name(sid + ".dvc").exists():
                t.add_row(tdir.name[:12], sid, "remote only (tidespec snapshots pull)", "", "", "", "")
    console.print(t)

@snap_app.command("seal")
def snapshots_seal(root: Path = ROOT, params: Path = PARAMS,
                   publish: bool = typer.Option(True, help="dvc add + push, retention, drift, Prefect event"),
                   commit: bool = typer.Option(False, help="git-commit the snapshot's .dvc file")):
    """Seal what is captured under data/capture (finishing seals a crash interrupted) into snapshots."""
    from ..adapters.publish import Publisher
    from ..capture.snapshots import lock_capture_dir, recover, seal, unlock
    from ..capture.store import read_manifest, read_rows
    from ..config import load_params
    ws = ws_of(root)
    p = load_params(params)
    pub = Publisher.for_workspace(ws, p, commit=commit) if publish else None
    if pub and not (ws.root / ".dvc").is_dir():
        raise ValueError(f"{ws.root} is not a DVC repo: run `dvc init` and add a remote, or pass --no-publish")
    sealed = []
    for cap in sorted(d for d in (ws.root / "data" / "capture").glob("*") if d.is_dir()):
        rows = read_manifest(cap) or [r for f in cap.glob("sealing-*.jsonl") for r in read_rows(f)]
        if not rows:
            continue
        tid = rows[0].target_id
        held = lock_capture_dir(cap)  # CaptureDirBusy while a server's writer runs there
        try:
            infos = recover(cap, ws.snapshots, tid, p.serve.replica())
            info = seal(cap, ws.snapshots, tid, lock=False, replica_id=p.serve.replica())
        finally:
            unlock(held)
        for i in infos + ([info] if info else []):
            sealed.append({"snapshot_id": i.snapshot_id, "records": i.num_records, "tokens": i.num_tokens,
                           **(pub(i) if pub else {})})
    console.print_json(json.dumps(sealed, default=str))

@snap_app.command("pull")
def snapshots_pull(snapshot_id: str, root: Path = ROOT):
    """Restore a snapshot that retention left only on the DVC remote (`dvc pull <sid>.dvc`)."""
    from ..adapters import versioning
    ws = ws_of(root)
    found = list(ws.snapshots.glob(f"*/{snapshot_id}.dvc"))
    if not found:
        raise ValueError(f"no {snapshot_id}.dvc under {ws.snapshots}: `tidespec snapshots list` shows the ids")
    versioning.pull(ws.root, found)
    console.print(f"pulled {found[0].with_suffix('')}")
