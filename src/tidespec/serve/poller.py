"""The server's background checks (the champion watchers, the draft-health guard): one loop."""
from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class Poller:
    """Calls `self.check()` every `every_s` s on a daemon thread (`_start`; none when `every_s` ≤ 0:
    a test calls `check` directly). A check that raises is logged with `what` and polling goes on;
    `close()` stops it, waiting at most 5 s for a check in progress."""

    what = "background check"

    def _start(self, every_s: float, name: str) -> None:
        self._stop = threading.Event()
        self._thread = None
        if every_s > 0:
            self._thread = threading.Thread(target=self._run, args=(every_s,), name=name, daemon=True)
            self._thread.start()

    def check(self):
        """One round of the subclass's work; what it returns is its own."""
        raise NotImplementedError

    def _run(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                self.check()
            except Exception:
                log.exception("%s failed", self.what)

    def close(self) -> None:
        """Stop polling (waits at most 5 s for a check in progress)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
