"""Capture store: safetensors shards + JSONL manifest; snapshots (sealed, immutable).

Contract (DESIGN.md "Capture record"): per finished request `input_ids [T] int32`,
`loss_mask [T] uint8`, `aux_hidden_states [T, 3H] bf16`, `hidden_states [T, H] bf16`.
A shard is written to a temp name, fsynced, renamed; manifest lines are appended and fsynced
only after the rename, so a reader that trusts the manifest never sees a torn shard.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FIELDS = ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states")
DTYPES = {"input_ids": torch.int32, "loss_mask": torch.uint8,
          "aux_hidden_states": torch.bfloat16, "hidden_states": torch.bfloat16}


@dataclass(frozen=True)
class ManifestRow:
    request_id: str
    ts: str  # UTC ISO-8601
    workload: str
    target_id: str
    num_tokens: int
    acceptance_length: float  # serving-time τ
    shard: str  # file name relative to the manifest's directory
    offset: int  # record index inside the shard
    prompt_hash: str = ""
    prompt_id: str = ""


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def prompt_hash(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> str:
    """sha256 (16 hex) of the prompt tokens (loss_mask == 0 prefix)."""
    p = input_ids[loss_mask == 0].to(torch.int32).numpy().tobytes()
    return hashlib.sha256(p).hexdigest()[:16]


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def private_dir(d: Path) -> Path:
    """mkdir -p with 0700 (hidden states can be inverted to recover prompts)."""
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    return d


def write_shard(directory: Path, name: str, records: list[dict[str, torch.Tensor]]) -> Path:
    """Atomically write `records` as one safetensors shard `directory/name` (0600). Keys: `{i}.{field}`."""
    tensors = {}
    for i, r in enumerate(records):
        for f in FIELDS:
            tensors[f"{i}.{f}"] = r[f].to(DTYPES[f]).contiguous()
    tmp = directory / f".{name}.tmp"
    save_file(tensors, str(tmp), metadata={"records": str(len(records))})
    os.chmod(tmp, 0o600)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    final = directory / name
    os.replace(tmp, final)
    _fsync_dir(directory)
    return final


def append_manifest(manifest: Path, rows: list[ManifestRow]) -> None:
    """Append rows as JSON lines and fsync (after the shard rename)."""
    with open(manifest, "a") as fh:
        for r in rows:
            fh.write(json.dumps(asdict(r)) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.chmod(manifest, 0o600)


def read_manifest(directory: Path) -> list[ManifestRow]:
    """Rows of `directory/manifest.jsonl`; a torn last line (crash mid-append) is ignored."""
    m = Path(directory) / "manifest.jsonl"
    if not m.exists():
        return []
    rows = []
    for line in m.read_text().splitlines():
        try:
            rows.append(ManifestRow(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue
    return rows


def read_record(directory: Path, row: ManifestRow) -> dict[str, torch.Tensor]:
    """Load one record's tensors (see module docstring for shapes/dtypes)."""
    with safe_open(str(Path(directory) / row.shard), framework="pt") as f:
        return {k: f.get_tensor(f"{row.offset}.{k}") for k in FIELDS}


def iter_records(directory: Path) -> Iterator[tuple[ManifestRow, dict[str, torch.Tensor]]]:
    for row in read_manifest(directory):
        yield row, read_record(directory, row)


@dataclass(frozen=True)
class SnapshotInfo:
    snapshot_id: str
    path: Path
    target_id: str
    num_records: int
    num_tokens: int
    workloads: dict[str, int]


def seal(capture_dir: Path, snapshots_root: Path, target_id: str) -> SnapshotInfo | None:
    """Move every shard listed in the capture manifest into a new immutable snapshot.

    Layout: `snapshots_root/<target_id>/<snapshot_id>/{shards, manifest.jsonl, snapshot.json}`.
    Unlisted files (temp or torn shards) stay behind. Returns None when nothing was captured.
    Raises ValueError when the capture holds records of another target.
    """
    capture_dir = Path(capture_dir)
    rows = read_manifest(capture_dir)
    if not rows:
        return None
    others = {r.target_id for r in rows} - {target_id}
    if others:
        raise ValueError(f"capture {capture_dir} holds records of other targets {sorted(others)}; seal them separately")
    sid = "s" + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    dest = private_dir(Path(snapshots_root) / target_id / sid)
    tmp = private_dir(dest.with_name(f".{sid}.tmp"))
    for shard in sorted({r.shard for r in rows}):
        shutil.copy2(capture_dir / shard, tmp / shard)
    append_manifest(tmp / "manifest.jsonl", rows)
    workloads: dict[str, int] = {}
    for r in rows:
        workloads[r.workload] = workloads.get(r.workload, 0) + 1
    info = {"snapshot_id": sid, "target_id": target_id, "created": utc_now(), "num_records": len(rows),
            "num_tokens": sum(r.num_tokens for r in rows), "workloads": workloads}
    (tmp / "snapshot.json").write_text(json.dumps(info, indent=2))
    dest.rmdir()
    os.replace(tmp, dest)
    # the capture is consumed only after the snapshot exists
    for shard in sorted({r.shard for r in rows}):
        (capture_dir / shard).unlink(missing_ok=True)
    (capture_dir / "manifest.jsonl").unlink(missing_ok=True)
    return SnapshotInfo(sid, dest, target_id, info["num_records"], info["num_tokens"], workloads)


def list_snapshots(snapshots_root: Path, target_id: str) -> list[Path]:
    """Sealed snapshot dirs of a target, oldest first."""
    d = Path(snapshots_root) / target_id
    if not d.exists():
        return []
    return sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and (p / "snapshot.json").exists())
