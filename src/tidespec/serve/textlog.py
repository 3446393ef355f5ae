"""Text capture of served exchanges (`capture.mode: text`), shared by `tidespec serve` and the front
door: each successful exchange's request and response bodies are logged in the SageMaker Data
Capture format (`capture.text.TextCapture`), which `tidespec ingest` rehydrates into records."""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..capture.text import TextCapture

log = logging.getLogger(__name__)


class TextLog:
    """Logs exchanges to `capture` (None: logs nothing). Never fails a request: a write error (a
    full disk) is logged and the answer still goes out."""

    def __init__(self, capture: TextCapture | None):
        self.capture = capture

    def log(self, request_id: str, request: dict, response: dict | str) -> None:
        """One exchange: the request body as a dict, the response body (a dict, or a stream's
        server-sent events as sent), under `request_id` (the capture record's event id)."""
        if self.capture is None:
            return
        try:
            self.capture.log(request_id, request, response)
        except OSError:
            log.exception("text capture of request %s failed", request_id)

    def close(self) -> None:
        """Flush and close the capture file (at shutdown)."""
        if self.capture is not None:
            self.capture.close()
