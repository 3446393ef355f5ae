"""The engine's stepping thread: one background thread steps the engine while it has requests
(continuous batching: a request submitted between steps joins the next one). HTTP handlers submit
from the event loop; the engine resolves each request's Future on this thread."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

from ..engine.speculative import Engine
from ..engine.speculative import Request as EngineRequest

IDLE_WAIT_S = 0.5  # an idle thread re-checks for work (and for close) at least this often, s

log = logging.getLogger(__name__)


class EngineLoop:
    """Steps `engine` on one daemon thread while it has unfinished requests; `submit` is thread-safe."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tidespec-engine", daemon=True)
        self._thread.start()

    def submit(self, req: EngineRequest) -> Future:
        """Queue `req` and wake the stepping thread; the Future resolves to its `Generation` (or to
        the exception the engine failed it with). Raises ValueError for a request the engine
        refuses (`Engine.validate`): nothing is queued then."""
        fut = self.engine.submit(req)
        with self._wake:
            self._wake.notify()
        return fut

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stop and self.engine.num_unfinished == 0:
                    self._wake.wait(IDLE_WAIT_S)
                if self._stop and self.engine.num_unfinished == 0:
                    return
            try:
                self.engine.step()
            except Exception:  # an engine bug outside a step's own error handling: log, keep stepping
                log.exception("engine step failed outside its request handling; the engine keeps stepping")

    def close(self, timeout_s: float = 60.0) -> None:
        """Finish the requests in flight, then stop the thread (waits at most `timeout_s` s)."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(timeout_s)
