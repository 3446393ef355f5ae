"""Snapshots: a capture directory sealed into `snapshots/<target_id>/<snapshot_id>/` (immutable: its shards
hard-linked or copied, its manifest, `snapshot.json`), crash-safe (an interrupted seal is finished by `recover`), one
writer per capture directory (`lock_capture_dir`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from filelock import FileLock, Timeout

from ..errors import TidespecError
from ..workspace import private_dir
from .store import (
    MANIFEST,
    _fsync_dir,
    _fsync_file,
    append_manifest,
    read_manifest,
    read_rows,
    trim_torn_tail,
    utc_now,
    write_private,
)

log = logging.getLogger(__name__)


# -- snapshots --------------------------------------------------------------------------------
@dataclass(frozen=True)
class SnapshotInfo:
    snapshot_id: str
    path: Path
    target_id: str
    num_records: int
    num_tokens: int
    workloads: dict[str, int]
    num_bytes: int = 0
    reason: str = "manual"  # why it was sealed: manual | tokens | age
    extra: dict = field(default_factory=dict)
    replica_id: str | None = None  # the replica that sealed it (`serve.replica_id`; None: sealed before fleets)

    @property
    def bytes_per_token(self) -> float:
        return self.num_bytes / self.num_tokens if self.num_tokens else 0.0


def new_snapshot_id(replica_id: str | None = None) -> str:
    """`s<UTC time, µs>-<replica_id>-<4 random hex>` (without a replica id: `s<UTC time, µs>-<4 random
    hex>`, the ids of snapshots sealed before fleets): sorts by seal time, old and new ids together;
    unique across a fleet (each replica's own id, and the time and random part within one)."""
    when = "s" + datetime.now(UTC).strftime("%Y%m%dT%H%M%S%fZ")
    return f"{when}-{replica_id}-{os.urandom(2).hex()}" if replica_id else f"{when}-{os.urandom(2).hex()}"


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except FileExistsError:
        dst.unlink()
        _link_or_copy(src, dst)
    except OSError:  # another filesystem (or no hard links): copy + fsync
        shutil.copyfile(src, dst)
        os.chmod(dst, 0o600)
        _fsync_file(dst)


def _finish_seal(capture_dir: Path, snapshots_root: Path, target_id: str, sid: str,
                 reason: str, replica_id: str | None = None) -> SnapshotInfo | None:
    """Build snapshot `sid` from `capture_dir/sealing-<sid>.jsonl`, then drop the capture's copies.
    Idempotent: rerun after a crash at any point gives the same snapshot."""
    sealing = capture_dir / f"sealing-{sid}.jsonl"
    rows = read_rows(sealing)
    dest = Path(snapshots_root) / target_id / sid
    if rows and not (dest / "snapshot.json").exists():
        private_dir(dest.parent)
        tmp = dest.with_name(f".{sid}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        private_dir(tmp)
        shards = sorted({r.shard for r in rows})
        for s in shards:
            _link_or_copy(capture_dir / s, tmp / s)
        append_manifest(tmp / MANIFEST, rows)
        workloads: dict[str, int] = {}
        for r in rows:
            workloads[r.workload] = workloads.get(r.workload, 0) + 1
        nbytes = sum((tmp / s).stat().st_size for s in shards)
        ntok = sum(r.num_tokens for r in rows)
        info = {"snapshot_id": sid, "target_id": target_id, "created": utc_now(), "reason": reason,
                "num_records": len(rows), "num_tokens": ntok, "num_bytes": nbytes,
                "bytes_per_token": nbytes / ntok if ntok else 0.0, "workloads": workloads,
                "first_ts": min(r.ts for r in rows), "last_ts": max(r.ts for r in rows),
                "codecs": sorted({"zstd" if s.endswith(".zst") else "none" for s in shards})}
        if replica_id:
            info["replica_id"] = replica_id
        write_private(tmp / "snapshot.json", json.dumps(info, indent=2).encode())
        _fsync_dir(tmp)
        os.replace(tmp, dest)
        _fsync_dir(dest.parent)
    # the capture's copies go only once the snapshot exists
    for s in sorted({r.shard for r in rows}):
        (capture_dir / s).unlink(missing_ok=True)
    sealing.unlink(missing_ok=True)
    _fsync_dir(capture_dir)
    return load_snapshot(dest) if rows else None


def load_snapshot(path: Path) -> SnapshotInfo:
    """SnapshotInfo from `path/snapshot.json`. Raises FileNotFoundError if it is not a sealed snapshot."""
    path = Path(path)
    info = json.loads((path / "snapshot.json").read_text())
    return SnapshotInfo(info["snapshot_id"], path, info["target_id"], info["num_records"], info["num_tokens"],
                        info.get("workloads", {}), info.get("num_bytes", 0), info.get("reason", "manual"),
                        {k: info[k] for k in ("first_ts", "last_ts", "codecs") if k in info},
                        info.get("replica_id"))


def recover(capture_dir: Path, snapshots_root: Path | None = None, target_id: str | None = None,
            replica_id: str | None = None) -> list[SnapshotInfo]:
    """After a crash: remove temp files and shards no manifest lists (never acknowledged), cut a
    torn manifest tail, and finish interrupted seals (when `snapshots_root` is given; else they are
    left, logged; `replica_id` as in `seal`). Call it only while holding the capture dir's lock.
    Returns the snapshots it finished."""
    capture_dir = Path(capture_dir)
    if not capture_dir.exists():
        return []
    for tmp in capture_dir.glob(".*.tmp"):
        tmp.unlink(missing_ok=True)
    if trim_torn_tail(capture_dir / MANIFEST):
        log.warning("%s: cut a torn last line (crash mid-append; that record was never acknowledged)", capture_dir)
    listed = {r.shard for r in read_manifest(capture_dir)}
    listed |= {r.shard for f in capture_dir.glob("sealing-*.jsonl") for r in read_rows(f)}
    for shard in capture_dir.glob("shard-*"):  # written, but its manifest rows never were: not acknowledged
        if shard.name not in listed:
            log.warning("%s: removing unlisted shard %s (crash before its manifest append)", capture_dir, shard.name)
            shard.unlink(missing_ok=True)
    done = []
    for sealing in sorted(capture_dir.glob("sealing-*.jsonl")):
        sid = sealing.stem.removeprefix("sealing-")
        rows = read_rows(sealing)
        tid = target_id or (rows[0].target_id if rows else "")
        if snapshots_root is None:  # left for whoever seals (`tidespec snapshots seal`)
            log.warning("%s is an interrupted seal; `tidespec snapshots seal` finishes it", sealing)
            continue
        info = _finish_seal(capture_dir, snapshots_root, tid, sid, "recovered", replica_id)
        if info:
            done.append(info)
    if snapshots_root is not None and target_id:
        for tmp in (Path(snapshots_root) / target_id).glob(".*.tmp"):
            if not (capture_dir / f"sealing-{tmp.name[1:-4]}.jsonl").exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return done


class CaptureDirBusy(TidespecError):
    """Another writer (or sealer) holds this capture directory."""


def lock_capture_dir(capture_dir: Path) -> FileLock:
    """Exclusive, non-blocking lock on `<dir>/.lock` (flock through `filelock`, released by the kernel
    if the holder dies): one writer or sealer per capture dir. Returns the held lock, to pass to
    `unlock` (from any thread). Raises CaptureDirBusy."""
    lock = FileLock(private_dir(Path(capture_dir)) / ".lock", timeout=0, mode=0o600, thread_local=False,
                    fallback_to_soft=False)
    try:
        lock.acquire()
    except Timeout:
        raise CaptureDirBusy(f"{capture_dir} is in use by another capture writer or sealer (one per directory): "
                             "stop it, or seal through it (CaptureWriter.seal_now)") from None
    return lock


def unlock(lock: FileLock) -> None:
    """Release a `lock_capture_dir` lock."""
    lock.release(force=True)


def seal(capture_dir: Path, snapshots_root: Path, target_id: str, reason: str = "manual",
         lock: bool = True, replica_id: str | None = None) -> SnapshotInfo | None:
    """Move every record listed in the capture manifest into a new immutable snapshot.

    Layout: `snapshots_root/<target_id>/<snapshot_id>/{shards, manifest.jsonl, snapshot.json}`
    (snapshot.json: counts, bytes, bytes_per_token, workloads, first/last ts, reason, `created`: the
    seal time, and `replica_id`: the replica sealing it, which its id carries: `new_snapshot_id`). Unlisted
    files (temp or torn shards) stay behind. Returns None when nothing was captured. Takes the
    capture dir's lock (`lock=False` only for its holder: the writer thread). Raises CaptureDirBusy
    while a writer runs there (seal through it: `CaptureWriter.seal_now()`), ValueError when the
    capture holds records of another target.
    """
    capture_dir = Path(capture_dir)
    if lock:
        held = lock_capture_dir(capture_dir)
        try:
            return seal(capture_dir, snapshots_root, target_id, reason, lock=False, replica_id=replica_id)
        finally:
            unlock(held)
    recover(capture_dir, snapshots_root, target_id, replica_id)
    rows = read_manifest(capture_dir)
    if not rows:
        return None
    others = {r.target_id for r in rows} - {target_id}
    if others:
        raise ValueError(f"capture {capture_dir} holds records of other targets {sorted(others)}; seal them separately")
    sid = new_snapshot_id(replica_id)
    while (Path(snapshots_root) / target_id / sid).exists() or (
        Path(snapshots_root) / target_id / f".{sid}.tmp"
    ).exists():
        sid = new_snapshot_id(replica_id)
    os.replace(capture_dir / MANIFEST, capture_dir / f"sealing-{sid}.jsonl")
    _fsync_dir(capture_dir)
    return _finish_seal(capture_dir, snapshots_root, target_id, sid, reason, replica_id)


def list_snapshots(snapshots_root: Path, target_id: str) -> list[Path]:
    """Sealed snapshot dirs of a target present locally, oldest first."""
    d = Path(snapshots_root) / target_id
    if not d.exists():
        return []
    return sorted(p for p in d.iterdir() if p.is_dir() and not p.name.startswith(".")
                  and (p / "snapshot.json").exists())


def last_sealed(snapshots_root: Path, target_id: str, replica_id: str) -> float | None:
    """When `replica_id` sealed its newest snapshot of `target_id` still on local disk (s since the
    epoch, read off its id: `new_snapshot_id`); None: none there."""
    mine = [p.name for p in list_snapshots(snapshots_root, target_id) if p.name[24:-5] == replica_id]
    if not mine:
        return None
    return datetime.strptime(mine[-1][1:23], "%Y%m%dT%H%M%S%fZ").replace(tzinfo=UTC).timestamp()


class SealPublisher:
    """Publishes sealed snapshots (`on_seal(SnapshotInfo)`: DVC add + push, the Prefect event) on its own
    thread, so serving and capture never wait for it. A failed publish (remote or Prefect down) is
    logged, counted (`errors`) and retried after `retry_s` s, doubling, up to `attempts` tries; the
    sealed snapshot stays on local disk meanwhile, and the next seal's publish takes it along."""

    def __init__(self, on_seal, retry_s: float, attempts: int):
        self.on_seal, self.retry_s, self.attempts = on_seal, retry_s, attempts
        self.errors = 0
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tidespec-publish")
        self._closed = threading.Event()  # cuts a retry's backoff short at close()
        self._lock = threading.Lock()

    def publish(self, info: SnapshotInfo) -> None:
        self._pool.submit(self._run, info)

    def _run(self, info: SnapshotInfo) -> None:
        for attempt in range(self.attempts):
            try:
                self.on_seal(info)
                return
            except Exception:
                wait_s = self.retry_s * 2 ** attempt
                log.exception("publishing snapshot %s failed (try %d of %d; next in %.0f s, and the next seal's "
                              "publish takes it along)", info.snapshot_id, attempt + 1, self.attempts, wait_s)
                with self._lock:
                    self.errors += 1
            if attempt + 1 == self.attempts or self._closed.wait(wait_s):
                return

    def close(self, wait: bool = True) -> None:
        """Stop retrying; wait for a publish in progress when `wait`."""
        self._closed.set()
        self._pool.shutdown(wait=wait)
