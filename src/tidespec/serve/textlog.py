"""Text capture of served exchanges (`capture.mode: text`), shared by `tidespec serve` and the front
door: each successful exchange's request and response bodies are logged in the SageMaker Data
Capture format (`capture.text.TextCapture`), which `tidespec ingest` rehydrates into records.

The text capture's counterpart of the hidden-state writer's seal: `TextLog` counts the tokens it
logged and calls `on_threshold(tokens)` (on a thread of its own, never in the request's path) each
time `threshold_tokens` more were logged; `tidespec serve` turns that into the
`tidespec.capture.text` event on which the `tide-capture` deployment runs."""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..capture.text import TextCapture

log = logging.getLogger(__name__)


class TextLog:
    """Logs exchanges to `capture` (None: logs nothing). Never fails a request: a write error (a
    full disk) is logged and the answer still goes out."""

    def __init__(self, capture: TextCapture | None, threshold_tokens: int | None = None,
                 on_threshold: Callable[[int], object] | None = None):
        self.capture, self.threshold_tokens, self.on_threshold = capture, threshold_tokens, on_threshold
        self._lock, self._pending = threading.Lock(), 0

    def log(self, request_id: str, request: dict, response: dict | str) -> None:
        """One exchange: the request body as a dict, the response body (a dict, or a stream's
        server-sent events as sent), under `request_id` (the capture record's event id)."""
        if self.capture is None:
            return
        try:
            written = self.capture.log(request_id, request, response)
        except OSError:
            log.exception("text capture of request %s failed", request_id)
            return
        if written and self.on_threshold is not None and self.threshold_tokens:
            self._count(exchange_tokens(response))

    def _count(self, tokens: int) -> None:
        with self._lock:
            self._pending += tokens
            if self._pending < self.threshold_tokens:
                return
            n, self._pending = self._pending, 0
        threading.Thread(target=self._notify, args=(n,), name="tidespec-text-threshold", daemon=True).start()

    def _notify(self, tokens: int) -> None:
        try:
            self.on_threshold(tokens)
        except Exception:  # a missed notification is retried by the next threshold
            log.exception("text capture threshold notification (%d tokens) failed", tokens)

    def backlog_tokens(self) -> int | None:
        """Tokens logged since the last `on_threshold` call: captured, not yet handed to an ingest (None
        without a threshold: the hourly ingest's backlog is not known here). What the replica logs each
        round (`backends.live.replica_state`)."""
        if self.capture is None or self.on_threshold is None or not self.threshold_tokens:
            return None
        with self._lock:
            return self._pending

    def close(self) -> None:
        """Flush and close the capture file (at shutdown)."""
        if self.capture is not None:
            self.capture.close()


def exchange_tokens(response: dict | str) -> int:
    """Tokens of one exchange: `usage.total_tokens` of a whole response or of a stream's usage chunk
    (`stream_options.include_usage`); a stream without usage counts one token per data event (vLLM,
    SGLang and tidespec stream about one token per event; its prompt is not counted)."""
    if isinstance(response, dict):
        return int((response.get("usage") or {}).get("total_tokens") or 0)
    events, total = 0, 0
    for line in response.splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            events += 1
            try:
                total = int((json.loads(line[5:]).get("usage") or {}).get("total_tokens") or total)
            except (ValueError, AttributeError):
                continue
    return total or events
