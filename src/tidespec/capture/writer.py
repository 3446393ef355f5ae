"""Asynchronous capture writer: a bounded queue drained by a background thread (`CaptureWriter`).

`submit` never blocks the engine: it only enqueues. Records are dropped and counted by reason
(`capture_dropped_total{reason}`: queue full, disk quota or floor, closed, write error); the TIDE
filter (`capture.sample_rate` at admission, `capture.max_acceptance_rate` at finish) counts what it
skips (`filtered{reason}`). On the writer thread: shard encoding, atomic write, manifest append,
and sealing into a snapshot at the seal thresholds; publishing a seal (DVC, the Prefect event)
runs on a third thread (`snapshots.SealPublisher`). The engine owns the wiring:
`Engine(capture=writer)` asks `wants()` at admission and hands `submit_generation()` each captured
request (`engine.generation.CaptureSink`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import queue
import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import CaptureParams
from ..hashing import unit_hash
from ..workspace import private_dir
from .metrics import CaptureCollector
from .recent import RecentRecords
from .snapshots import SealPublisher, SnapshotInfo, lock_capture_dir, recover, seal, unlock
from .store import (
    ManifestRow,
    append_manifest,
    checked_positions,
    encode_shard,
    is_tokens_only,
    parse_ts,
    prompt_hash,
    read_manifest,
    shard_name,
    utc_now,
    validate_record,
    write_shard,
)
from .text import MB

log = logging.getLogger(__name__)
_STOP = object()
PUBLISH_RETRY_S = 30.0  # first wait after a failed publish (DVC remote or Prefect down); doubles each try
PUBLISH_ATTEMPTS = 6  # tries per snapshot (≈ 30 min of backoff); after that the next seal's publish takes it along
SEAL_RETRY_S = 60.0  # after a failed seal (snapshots root unwritable...), capture goes on; retry then


@dataclass(frozen=True)
class CaptureStats:
    """Counters of one writer (Prometheus names: `capture_<field>`; bytes/token for the bench)."""

    written_total: int
    tokens_total: int
    bytes_total: int  # shard bytes written (after compression)
    dropped: dict[str, int] = field(default_factory=dict)  # reason → records
    filtered: dict[str, int] = field(default_factory=dict)  # reason → requests not captured by the filter
    sealed_total: int = 0
    unsealed_tokens: int = 0
    queue_depth: int = 0
    publish_errors: int = 0
    seal_errors: int = 0
    write_cpu_s: float = 0.0  # writer-thread CPU time spent encoding + writing shards (s)
    write_wall_s: float = 0.0  # wall time of the same (incl. fsync waits) (s)

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_total / self.tokens_total if self.tokens_total else 0.0


class CaptureWriter:
    """Writes finished requests to `directory` as shards of `cfg.shard_max_records` records, as
    `cfg` (`CaptureParams`, whole: queue, shards, compression, disk quota and floor, sample rate,
    the acceptance filter, store_text, seal thresholds; default `CaptureParams()`) says.
    With `snapshots_root`, seals `directory` into `snapshots_root/<target_id>/<sid>/` at
    `cfg.seal_min_tokens` unsealed tokens or `cfg.seal_max_age_s` (the oldest unsealed record's age),
    and publishes each seal with `on_seal(SnapshotInfo)` (`snapshots.SealPublisher`: its own thread,
    retried `publish_attempts` times from `publish_retry_s` s). On start it removes temp files, finishes and
    publishes seals a crash interrupted, else publishes the newest of `unpublished` (`Publisher.pending`; each
    publish takes older unpublished ones along); snapshot ids carry `replica_id` (`serve.replica_id`).
    Holds an exclusive lock on `directory` until `close()`: another writer or an offline `seal` gets CaptureDirBusy."""

    def __init__(self, directory: Path, target_id: str, cfg: CaptureParams | None = None, *,
                 snapshots_root: Path | None = None, on_seal: Callable[[SnapshotInfo], object] | None = None,
                 idle_flush_s: float = 2.0, seed: int = 0, detokenize: Callable[[list[int]], str] | None = None,
                 publish_retry_s: float = PUBLISH_RETRY_S, publish_attempts: int = PUBLISH_ATTEMPTS,
                 replica_id: str | None = None, unpublished: Sequence[SnapshotInfo] = ()):
        self.cfg = cfg = cfg or CaptureParams()
        self.dir = private_dir(Path(directory))
        self._dir_lock = lock_capture_dir(self.dir)  # one writer per directory; raises CaptureDirBusy
        self.target_id, self.manifest = target_id, self.dir / "manifest.jsonl"
        self.quota, self.min_free = cfg.disk_quota_mb * MB if cfg.disk_quota_mb else None, cfg.min_free_disk_mb * MB
        self.seed, self.detokenize, self.on_seal, self.idle_flush_s = seed, detokenize, on_seal, idle_flush_s
        self.snapshots_root, self.replica_id = Path(snapshots_root) if snapshots_root else None, replica_id
        self.q: queue.Queue = queue.Queue(maxsize=cfg.queue_size)
        self._lock = threading.Lock()  # counters
        self._dropped, self._filtered = Counter(), Counter()  # reason → requests
        self.written_total = self.tokens_total = self.bytes_total = self.sealed_total = self.seal_errors = 0
        self._seal_retry_at, self._closing = 0.0, False
        self._submit_lock = threading.Lock()  # orders submits against close(): nothing enters after STOP
        self.write_cpu_s = self.write_wall_s = 0.0
        self.error: BaseException | None = None
        self._full: str | None = None  # latched drop reason (quota / disk) until a seal frees space
        self._pending: list[tuple[dict, dict]] = []
        self.recent = RecentRecords()  # the newest records, for the draft-health guard's paired scoring
        self._publisher = SealPublisher(on_seal, publish_retry_s, publish_attempts) if on_seal else None
        for info in recover(self.dir, self.snapshots_root, target_id, replica_id) or list(unpublished)[-1:]:
            if self._publisher:
                self._publisher.publish(info)
        self._rescan()
        self._thread = threading.Thread(target=self._run, name="tidespec-capture", daemon=True)
        self._thread.start()

    # -- engine side (never blocks) -------------------------------------------------------
    def wants(self, request_id: str) -> bool:
        """Admission: capture this request? (`sample_rate`, by request-id hash; counts `sampled_out`).
        Ask before serving so unsampled requests do not even collect hidden states."""
        if self.cfg.sample_rate >= 1.0 or unit_hash(f"capture:{self.seed}:{request_id}") < self.cfg.sample_rate:
            return True
        with self._lock:
            self._filtered["sampled_out"] += 1
        return False

    def submit(self, record: dict[str, torch.Tensor], *, request_id: str, workload: str,
               acceptance_length: float, prompt_id: str = "", acceptance_rate: float | None = None,
               text: dict | None = None, origin: str = "live", constraint: dict | None = None,
               rejected: list[int] | None = None) -> bool:
        """Enqueue one finished request (tensors per store.FIELDS, any float dtype: cast to bf16 on the
        writer thread). `acceptance_rate`: serving-time accepted/drafted (None: no drafts), filtered
        by `max_acceptance_rate`. `text` ({"prompt", "completion"}) is kept only with `store_text`;
        `constraint`: a constrained request's spec (replay and evaluation constrain it the same way).
        `rejected`: `ManifestRow.rejected`. Returns True if queued; False if filtered or dropped (both
        counted). Raises ValueError for a record that breaks the contract (`store.validate_record`) or a
        `rejected` position outside it, before anything is queued."""
        if (self.cfg.max_acceptance_rate is not None and acceptance_rate is not None
                and acceptance_rate >= self.cfg.max_acceptance_rate):
            with self._lock:
                self._filtered["high_acceptance"] += 1
            return False
        T = validate_record(record)
        rejected = None if rejected is None else checked_positions(rejected, T)
        rate = None if acceptance_rate is None else float(acceptance_rate)
        meta = dict(request_id=request_id, workload=workload, acceptance_length=float(acceptance_length),
                    origin=origin, acceptance_rate=rate, prompt_id=prompt_id, ts=utc_now(),
                    text=text if self.cfg.store_text else None, constraint=constraint, rejected=rejected)
        with self._submit_lock:
            reason = "closed" if self._closing or not self._thread.is_alive() else self._full
            if reason is None:
                try:
                    self.q.put_nowait((record, meta))
                    return True
                except queue.Full:
                    reason = "queue_full"
        with self._lock:
            self._dropped[reason] += 1
        return False

    def submit_generation(self, gen, workload: str = "default", prompt_id: str = "") -> bool:
        """`submit` a finished engine Generation that was captured (the engine's capture hook calls
        this: `engine.speculative.CaptureSink`): its record, request id, serving-time τ (every
        proposer) and the EAGLE3 draft's acceptance rate (None when the draft drafted nothing for
        it: the filter keeps the requests the draft serves worst, whatever the suffix proposer
        added), where its proposals were rejected (`rejected_positions`). With `store_text` and a
        `detokenize` callable, prompt and completion text go into the manifest. Raises ValueError for
        a Generation without a record."""
        if gen.record is None:
            raise ValueError(f"request {gen.request_id} has no capture record: submit it with capture=True")
        self.recent.submit_generation(gen, workload, prompt_id)
        text = None
        if self.cfg.store_text and self.detokenize is not None:
            ids = gen.record["input_ids"].tolist()
            text = {"prompt": self.detokenize(ids[:gen.prompt_len]), "completion": self.detokenize(gen.tokens)}
        return self.submit(gen.record, request_id=gen.request_id, workload=workload, prompt_id=prompt_id, text=text,
                           acceptance_length=gen.stats.acceptance_length, acceptance_rate=draft_acceptance_rate(gen),
                           constraint=gen.constraint, rejected=rejected_positions(gen))

    def collector(self):
        """A prometheus-client collector over this writer's counters (`capture.metrics`)."""
        return CaptureCollector(self)

    def stats(self) -> CaptureStats:
        """A consistent snapshot of the counters (thread-safe; cheap enough for every scrape)."""
        with self._lock:
            return CaptureStats(self.written_total, self.tokens_total, self.bytes_total, dict(self._dropped),
                                dict(self._filtered), self.sealed_total, self._unsealed_tokens, self.q.qsize(),
                                self.publish_errors, self.seal_errors, self.write_cpu_s, self.write_wall_s)

    @property
    def publish_errors(self) -> int:
        """Failed publish attempts so far (each retried, `SealPublisher`)."""
        return self._publisher.errors if self._publisher else 0

    # -- control ---------------------------------------------------------------------------
    def _command(self, name: str, timeout_s: float) -> Future:
        return command(self.q, self._thread, name, timeout_s, self.error)

    def flush(self, timeout_s: float = 60.0) -> None:
        """Block until everything queued so far is on disk (pending shard written). Raises
        RuntimeError if a write failed since the last flush (once), TimeoutError if the disk is too
        slow (`timeout_s`)."""
        self._command("flush", timeout_s).result(timeout_s)
        err, self.error = self.error, None  # reported once; the writer keeps going
        if err:
            raise RuntimeError(f"capture writer failed since the last flush (records counted as dropped "
                               f"'write_error'): {err}") from err

    def seal_now(self, timeout_s: float = 120.0) -> SnapshotInfo | None:
        """Write what is queued and seal it into a snapshot now (None if nothing was captured).
        Needs `snapshots_root`."""
        if self.snapshots_root is None:
            raise ValueError("this writer has no snapshots_root: construct it with one to seal")
        return self._command("seal", timeout_s).result(timeout_s)

    def close(self, timeout_s: float = 60.0) -> None:
        """Write everything queued, stop the writer thread and wait for publishing; idempotent.
        Later `submit` calls are dropped and counted (`closed`). Unsealed records stay for the next
        writer. Raises TimeoutError when the disk does not let it finish in `timeout_s` s,
        RuntimeError if a write failed since the last flush."""
        with self._submit_lock:
            self._closing = True  # from here submits are dropped ("closed"): nothing follows STOP
        deadline = time.monotonic() + timeout_s
        try:
            if self._thread.is_alive():
                try:
                    self.q.put(_STOP, timeout=timeout_s)  # after every queued record: all get written
                except queue.Full:
                    log.error("capture writer stuck (disk?): %d records not written", self.q.qsize())
                self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
                if self._thread.is_alive():
                    raise TimeoutError(f"capture writer did not finish within {timeout_s:g} s (disk stalled?); "
                                       "its records stay queued in this process")
        finally:
            if self._publisher:
                self._publisher.close(wait=not self._thread.is_alive())
            if self._dir_lock is not None and not self._thread.is_alive():
                unlock(self._dir_lock)
                self._dir_lock = None
        err, self.error = self.error, None
        if err:
            raise RuntimeError(f"capture writer failed (records counted as dropped 'write_error'): {err}") from err

    # -- writer thread ---------------------------------------------------------------------
    def _rescan(self) -> None:
        rows = read_manifest(self.dir)
        with self._lock:
            self._unsealed_tokens = sum(r.num_tokens for r in rows)
        self._oldest = min((parse_ts(r.ts) for r in rows), default=None)
        self._usage = sum(p.stat().st_size for p in self.dir.iterdir() if p.is_file())

    def _run(self) -> None:
        while True:
            try:
                item = self.q.get(timeout=self.idle_flush_s)
            except queue.Empty:
                item = ("idle", None)
            if item is _STOP:
                try:
                    self._write_pending()
                except Exception as e:  # noqa: BLE001 - counted, reported by close()
                    self._fail(e, [])
                return
            kind, arg = item if isinstance(item[0], str) else ("record", None)
            try:
                if kind == "record":
                    self._pending.append(item)
                    if len(self._pending) >= self.cfg.shard_max_records:
                        self._write_pending()
                elif kind == "idle":  # traffic paused: nothing lingers in memory; space may be back
                    self._write_pending()
                    if self._full and self._disk_reason(0) is None:
                        self._full = None
                else:  # flush | seal (a flush also applies the seal thresholds, as a record would)
                    self._write_pending()
                    if kind == "seal":
                        info = self._seal("manual")
                    else:
                        self._maybe_seal()
                        info = None
                    arg.set_result(info)
                    continue
                self._maybe_seal()
            except Exception as e:  # noqa: BLE001 - keep serving; reported on flush
                self._fail(e, [])
                if kind in ("flush", "seal") and not arg.done():
                    arg.set_exception(e)

    def _fail(self, e: BaseException, batch: list) -> None:
        log.error("capture write failed (%d records dropped): %r", len(batch) + len(self._pending), e)
        self.error = e
        with self._lock:
            self._dropped["write_error"] += len(batch) + len(self._pending)
        self._pending = []

    def _disk_reason(self, nbytes: int) -> str | None:
        if self.quota is not None and self._usage + nbytes > self.quota:
            return "disk_quota"
        if self.min_free and shutil.disk_usage(self.dir).free - nbytes < self.min_free:
            return "disk_full"
        return None

    def _write_pending(self) -> None:
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        c0, w0 = time.thread_time(), time.perf_counter()
        try:
            data = encode_shard([r for r, _ in batch], self.cfg.compression, True, self.cfg.hidden_dtype)  # validated
            rows = manifest_rows(batch, self.target_id)
        except Exception as e:  # noqa: BLE001 - one bad batch (validated at submit: should not happen)
            self._fail(e, batch)
            return
        size = len(data) + 512 * len(rows)  # + manifest lines
        reason = self._disk_reason(size)
        if reason:
            # latch (drop at submit) only when sealing can free space; a lone oversized batch is just dropped
            self._full = reason if (reason == "disk_full" or self._usage > 0) else None
            with self._lock:
                self._dropped[reason] += len(batch)
            log.warning("capture %s: %d records dropped; a seal or free space resumes it", reason, len(batch))
            return
        name = shard_name(f"shard-{time.time_ns()}", self.cfg.compression)
        rows = [dataclasses.replace(r, shard=name) for r in rows]
        try:
            path = write_shard(self.dir, name, data)
            append_manifest(self.manifest, rows)
        except Exception as e:  # noqa: BLE001 - disk error: these records are lost, counted
            self._fail(e, batch)
            return
        size = path.stat().st_size
        ntok = sum(r.num_tokens for r in rows)
        self._usage += size + sum(len(json.dumps(dataclasses.asdict(r))) + 1 for r in rows)
        self._oldest = min(self._oldest or time.time(), min(parse_ts(r.ts) for r in rows))
        with self._lock:
            self.write_cpu_s += time.thread_time() - c0
            self.write_wall_s += time.perf_counter() - w0
            self.bytes_total += size
            self.written_total += len(rows)
            self.tokens_total += ntok
            self._unsealed_tokens += ntok

    def _maybe_seal(self) -> None:
        if self.snapshots_root is None or self._oldest is None or time.monotonic() < self._seal_retry_at:
            return
        reason = None
        if self.cfg.seal_min_tokens and self._unsealed_tokens >= self.cfg.seal_min_tokens:
            reason = "tokens"
        elif self.cfg.seal_max_age_s and time.time() - self._oldest >= self.cfg.seal_max_age_s:
            self._write_pending()
            reason = "age"
        if reason:
            try:
                self._seal(reason)
            except Exception as e:  # noqa: BLE001 - capture goes on into the capture dir (quota applies)
                log.error("seal failed (retry in %.0f s; capture continues): %r", SEAL_RETRY_S, e)
                with self._lock:
                    self.seal_errors += 1
                self._seal_retry_at = time.monotonic() + SEAL_RETRY_S

    def _seal(self, reason: str) -> SnapshotInfo | None:
        if self.snapshots_root is None:
            raise ValueError("no snapshots_root")
        info = seal(self.dir, self.snapshots_root, self.target_id, reason, lock=False, replica_id=self.replica_id)
        self._rescan()
        self._full = None if self._disk_reason(0) is None else self._full
        if info:
            with self._lock:
                self.sealed_total += 1
            if self._publisher:
                self._publisher.publish(info)
        return info


def command(q: queue.Queue, thread: threading.Thread, name: str, timeout_s: float, error) -> Future:
    """Queue a control command ("flush", "seal") behind the records for the writer `thread`; returns the
    Future it resolves. Raises RuntimeError when the thread is gone (`error`: why), TimeoutError when
    the queue does not take it within `timeout_s` s."""
    fut: Future = Future()
    deadline = time.monotonic() + timeout_s
    while True:
        if not thread.is_alive():
            raise RuntimeError(f"capture writer is not running ({error or 'closed'})")
        try:
            q.put((name, fut), timeout=0.1)
            return fut
        except queue.Full:
            if time.monotonic() > deadline:
                raise TimeoutError("capture queue did not drain") from None


def draft_acceptance_rate(gen) -> float | None:
    """The draft model's acceptance rate on a Generation (`Generation.draft_stats`: the proposers that
    ran it; None when it drafted nothing for it)."""
    draft = gen.draft_stats
    return draft.acceptance_rate if draft is not None and draft.num_draft_tokens else None


def rejected_positions(gen) -> list[int] | None:
    """A captured Generation's rejected tokens (`Generation.rejected`, indices into its tokens) as the
    record positions whose next-token distribution produced them: token t sits at prompt_len + t in
    prompt + tokens, and the target's hidden state one position before it gave it (the draft was
    wrong about that distribution; what `train.rejected_weight` weighs, as the trainer holds a row to
    the distribution at a position). None when no draft-model proposer ran for the request."""
    if not gen.draft_kinds or gen.draft_stats is None:
        return None
    return [gen.prompt_len + t - 1 for t in gen.rejected if t >= 1]  # token 0 comes from the prefill


def manifest_rows(batch: list[tuple[dict, dict]], target_id: str) -> list[ManifestRow]:
    """The manifest rows of a batch of (record, metadata) about to be written as one shard (shard name
    set when it is)."""
    return [ManifestRow(request_id=m["request_id"], ts=m["ts"], workload=m["workload"], target_id=target_id,
                        num_tokens=int(r["input_ids"].shape[0]), acceptance_length=m["acceptance_length"], shard="",
                        offset=i, prompt_hash=prompt_hash(r["input_ids"], r["loss_mask"]), prompt_id=m["prompt_id"],
                        acceptance_rate=m["acceptance_rate"], text=m["text"], origin=m["origin"],
                        constraint=m["constraint"], tokens_only=is_tokens_only(r), rejected=m["rejected"])
            for i, (r, m) in enumerate(batch)]


__all__ = ["CaptureWriter", "CaptureStats"]
