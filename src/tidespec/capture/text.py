"""Text capture (`capture.mode: text`): `tidespec serve` logs each finished request's OpenAI request and
response bodies instead of hidden states, in SageMaker Data Capture's JSON Lines record format
(`captureData.endpointInput` / `endpointOutput` with `data`, `encoding: JSON`, `mode`,
`observedContentType`; `eventMetadata.eventId`, `inferenceTime`; `eventVersion` "0"; AWS SageMaker
Developer Guide, "Capture data from real-time endpoint"), one file per UTC hour under
`<directory>/<variant>/yyyy/mm/dd/hh/`. `tidespec ingest` (a local directory in `ingest.sources`)
rehydrates them exactly like endpoint traffic, so a server that cannot spare the memory for hidden
states, or a fleet of servers behind any gateway, feeds the same loop. Text is sensitive: the
directory is private (0700, files 0600) like the hidden-state capture.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

from ..config import CaptureParams
from ..hashing import unit_hash
from ..workspace import private_dir

VARIANT = "AllTraffic"
MB = 1 << 20  # capture.*_mb units (as the hidden-state writer counts them)
log = logging.getLogger(__name__)


def capture_line(event_id: str, request: dict, response: dict | str, when: datetime) -> str:
    """One record in the Data Capture layout: the request as JSON, the response as JSON (a dict) or as
    the server-sent-events text of a stream (`text/event-stream`)."""
    out = response if isinstance(response, str) else json.dumps(response, ensure_ascii=False)
    ctype = "text/event-stream" if isinstance(response, str) else "application/json"
    cap = {"endpointInput": {"observedContentType": "application/json", "mode": "INPUT",
                             "data": json.dumps(request, ensure_ascii=False), "encoding": "JSON"},
           "endpointOutput": {"observedContentType": ctype, "mode": "OUTPUT", "data": out, "encoding": "JSON"}}
    meta = {"eventId": event_id, "inferenceTime": when.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"}
    return json.dumps({"captureData": cap, "eventMetadata": meta, "eventVersion": "0"}, ensure_ascii=False)


class TextCapture:
    """Appends capture records to hourly files (one writer per directory and process; each line is
    flushed and fsynced before `log` returns, so a crash loses at most the line being written, which
    the ingest counts as `truncated`). `cfg` (`CaptureParams`, whole; default its defaults):
    `sample_rate`, share of requests logged, by request-id hash (`wants`, the same rule as the
    hidden-state writer); `disk_quota_mb`, the most the directory may hold (MB; text waits there for
    `tidespec ingest`, which never deletes it: remove ingested hours to make room); `min_free_disk_mb`,
    the free space kept on its filesystem. An exchange over either limit is dropped and counted
    (`dropped[reason]`, reasons `disk_quota` / `disk_full`), never waited for. Raises ValueError for
    `max_acceptance_rate` (text is logged without the draft's acceptance: hidden-state capture only)."""

    def __init__(self, directory: Path, cfg: CaptureParams | None = None, seed: int = 0):
        cfg = cfg or CaptureParams()
        if cfg.max_acceptance_rate is not None:
            raise ValueError("capture.max_acceptance_rate filters hidden-state capture (capture.mode: hidden, "
                             "the embedded engine): text capture has no acceptance; remove it")
        self.dir = private_dir(Path(directory))
        self.cfg, self.sample_rate, self.seed = cfg, cfg.sample_rate, seed
        self._lock = threading.Lock()
        self._file, self._hour = None, None
        self.written_total = self.bytes_total = self.sampled_out = 0
        self.dropped: Counter[str] = Counter()
        self._held = sum(p.stat().st_size for p in self.dir.rglob("*") if p.is_file())  # bytes in the directory
        self._stem = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def wants(self, request_id: str) -> bool:
        """Log this request? (`sample_rate`, by request-id hash; counts `sampled_out`)."""
        if self.sample_rate >= 1.0 or unit_hash(f"capture:{self.seed}:{request_id}") < self.sample_rate:
            return True
        with self._lock:
            self.sampled_out += 1
        return False

    def log(self, event_id: str, request: dict, response: dict | str) -> int:
        """Append one exchange (if `wants(event_id)` and within the disk limits); returns the bytes
        written (0: sampled out or dropped)."""
        if not self.wants(event_id):
            return 0
        now = datetime.now(UTC)
        data = (capture_line(event_id, request, response, now) + "\n").encode()
        with self._lock:
            reason = self._over_limit(len(data))
            if reason:
                if not self.dropped:
                    log.warning("text capture is dropping exchanges (%s) under %s", reason, self.dir)
                self.dropped[reason] += 1
                return 0
            f = self._open(now)
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            self.written_total += 1
            self.bytes_total += len(data)
            self._held += len(data)
        return len(data)

    def _over_limit(self, n: int) -> str | None:
        quota, floor = self.cfg.disk_quota_mb, self.cfg.min_free_disk_mb
        if quota is not None and self._held + n > quota * MB:
            return "disk_quota"
        if floor and shutil.disk_usage(self.dir).free - n < floor * MB:
            return "disk_full"
        return None

    def _open(self, now: datetime):
        hour = now.strftime("%Y/%m/%d/%H")
        if hour != self._hour:
            if self._file is not None:
                self._file.close()
            d = private_dir(self.dir / VARIANT / hour)
            path = d / f"{now.strftime('%M-%S')}-{self._stem}.jsonl"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._file, self._hour = os.fdopen(fd, "ab"), hour
        return self._file

    def flush(self) -> None:
        """Nothing is buffered (each line is fsynced); kept for the server's shutdown hook."""

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file, self._hour = None, None
