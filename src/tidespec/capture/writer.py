"""Asynchronous capture writer: a bounded queue drained by a background thread.

`submit` never blocks the engine: when the queue is full the record is dropped and counted
(`capture_dropped_total`). Records are converted to bf16 and written on the writer thread.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

import torch

from .store import ManifestRow, append_manifest, private_dir, prompt_hash, utc_now, write_shard

log = logging.getLogger(__name__)
_STOP = object()


class CaptureWriter:
    """Writes finished requests to `directory` as shards of up to `shard_max_records` records.

    Counters: `written_total`, `dropped_total`, `bytes_total` (shard bytes on disk).
    """

    def __init__(self, directory: Path, target_id: str, queue_size: int = 64, shard_max_records: int = 16):
        self.dir = private_dir(Path(directory))
        for tmp in self.dir.glob(".*.tmp"):  # leftovers of a crash: never in the manifest
            tmp.unlink(missing_ok=True)
        self.manifest = self.dir / "manifest.jsonl"
        self.target_id = target_id
        self.shard_max = shard_max_records
        self.q: queue.Queue = queue.Queue(maxsize=queue_size)
        self.written_total = 0
        self.dropped_total = 0
        self.bytes_total = 0
        self.error: BaseException | None = None
        self._pending: list[tuple[dict, dict]] = []
        self._thread = threading.Thread(target=self._run, name="tidespec-capture", daemon=True)
        self._thread.start()

    def submit(self, record: dict[str, torch.Tensor], *, request_id: str, workload: str,
               acceptance_length: float, prompt_id: str = "") -> bool:
        """Enqueue one finished request (tensors per store.FIELDS). Returns False if dropped."""
        if not self._thread.is_alive():
            self.dropped_total += 1
            return False
        meta = dict(request_id=request_id, workload=workload, acceptance_length=float(acceptance_length),
                    prompt_id=prompt_id, ts=utc_now())
        try:
            self.q.put_nowait((record, meta))
            return True
        except queue.Full:
            self.dropped_total += 1
            return False

    def flush(self, timeout_s: float = 60.0) -> None:
        """Block until everything queued so far is on disk (pending shard written)."""
        done = threading.Event()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.q.put(("flush", done), timeout=0.1)
                break
            except queue.Full:
                if time.monotonic() > deadline:
                    raise TimeoutError("capture queue did not drain")
        if not done.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError("capture flush timed out")
        if self.error:
            raise RuntimeError(f"capture writer failed: {self.error}") from self.error

    def close(self) -> None:
        """Flush and stop the writer thread; idempotent. Later `submit` calls are dropped and counted."""
        if not self._thread.is_alive():
            return
        self.flush()
        self.q.put(_STOP)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is _STOP:
                return
            try:
                if item[0] == "flush":
                    self._write_pending()
                    item[1].set()
                    continue
                self._pending.append(item)
                if len(self._pending) >= self.shard_max:
                    self._write_pending()
            except Exception as e:  # keep serving; report on flush
                log.exception("capture write failed")
                self.error = e
                if item[0] == "flush":
                    item[1].set()

    def _write_pending(self) -> None:
        if not self._pending:
            return
        name = f"shard-{time.time_ns()}.safetensors"
        records = [r for r, _ in self._pending]
        path = write_shard(self.dir, name, records)
        rows = [ManifestRow(request_id=m["request_id"], ts=m["ts"], workload=m["workload"],
                            target_id=self.target_id, num_tokens=int(r["input_ids"].shape[0]),
                            acceptance_length=m["acceptance_length"], shard=name, offset=i,
                            prompt_hash=prompt_hash(r["input_ids"], r["loss_mask"]), prompt_id=m["prompt_id"])
                for i, (r, m) in enumerate(self._pending)]
        append_manifest(self.manifest, rows)
        self.bytes_total += path.stat().st_size
        self.written_total += len(rows)
        self._pending = []
