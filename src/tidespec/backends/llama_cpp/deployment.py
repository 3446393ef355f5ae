"""Deploy the champion into llama.cpp: blue/green, the only way a new draft gets in.

llama.cpp cannot load another draft into a running server: a single-model `llama-server` loads
`-md` once at start (`POST /props` changes nothing), and its router mode swaps one by restarting the
child process, which cuts the requests running there and resets its counters. So each new champion
gets a *green* server on a free port: its draft converted to an EAGLE-3 GGUF (`convert.draft_gguf`,
cached by content), started, checked to speculate (`/slots`), sent a canary completion; then the
front door switches to green, the requests still running on *blue* finish there (`Proxy.inflight`),
and blue stops. Any failure before the switch stops green and leaves blue serving. A swap costs a
second server's memory while both run (measured at each swap: `memory_mib`, docs/serving.md).

Live figures per version: a fresh server's cumulative counters are that version's alone, so
`ServedDraft.counters_base` stays None. `reload()` (the live guard's) is a blue/green swap to the
served draft's own files.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

import psutil

from ...adapters import process
from ...workspace import served_version
from ..base import ServedDeployment, ServedDraft, canary, drain
from .convert import draft_gguf
from .metrics import SpecDecodeCounters, scrape
from .server import LlamaCppError, LlamaCppLaunch, LlamaCppServer

log = logging.getLogger(__name__)


class LlamaCppDeployment(ServedDeployment):
    """The llama-server(s) serving the target GGUF `launch.model_path` behind `proxy` (a
    `frontdoor.Proxy`; None: no front door yet, `url` says where llama-server is). `target_hf_dir`:
    the target's HF dir the converter reads (`models.hf_files.target_dir`); `state_dir`: private copies
    of deployed drafts and the servers' logs; `cache`: the asset cache the converted drafts go to
    (None: `assets.cache_dir()`). `served`: what serves now (`backends.base.ServedDraft`)."""

    error = LlamaCppError

    def __init__(self, launch: LlamaCppLaunch, state_dir: Path, target_hf_dir: Path, proxy=None,
                 ready_timeout_s: float = 300.0, drain_timeout_s: float = 300.0, cache: Path | None = None):
        self.launch, self.state_dir, self.proxy = launch, Path(state_dir), proxy
        self.target_hf_dir = Path(target_hf_dir)
        self.ready_timeout_s, self.drain_timeout_s, self.cache = ready_timeout_s, drain_timeout_s, cache
        self.server: LlamaCppServer | None = None
        super().__init__("llama.cpp")

    def install(self, bundle: Path, version: str | None = None) -> dict:
        """Serve the draft in `bundle`, blue/green (module docstring). Returns {"draft_version", "url",
        "mode": "blue_green", "seconds" (the whole swap), "ready_seconds" (conversion and green's
        start), "drained" (False when blue still had requests after drain_timeout_s; it is stopped
        anyway), "memory_mib" (blue's and green's resident memory while both ran)}. Raises
        LlamaCppError (conversion failed; green died, did not speculate or failed the canary): the
        served draft keeps serving."""
        with self._swap:
            t0 = time.perf_counter()
            green, version, draft = self._launch(Path(bundle), process.free_port(self.launch.host), version)
            try:
                canary(green.url, self.launch.alias or "target", LlamaCppError)
            except BaseException:
                green.stop()
                raise
            ready, memory = time.perf_counter() - t0, _rss_mib(self.server) + _rss_mib(green)
            blue, old = self.server, self.proxy.switch(green.url) if self.proxy else None
            self._serving(green, version, draft)
            drained = drain(self.proxy, old, self.drain_timeout_s, self.engine) if old else True
            if blue:
                blue.stop()
            log.info("llama.cpp now serves draft %s at %s (green ready in %.1f s, %.0f MiB while both ran; "
                     "previous server stopped, drained=%s)", version, green.url, ready, memory, drained)
            return {"draft_version": version, "url": green.url, "mode": "blue_green",
                    "seconds": time.perf_counter() - t0, "ready_seconds": ready, "drained": drained,
                    "memory_mib": memory}

    def reload(self) -> dict:
        """Serve the served draft's own files again on a fresh server (blue/green: llama.cpp has no
        in-place load). Raises LlamaCppError (no draft served, or the swap failed)."""
        if self.draft_dir is None:
            raise LlamaCppError("no draft served to reload")
        return self.install(self.draft_dir, self.draft_version)

    def _launch(self, bundle: Path | None, port: int, version: str | None = None
                ) -> tuple[LlamaCppServer, str | None, Path | None]:
        """A started server with the draft in `bundle` (copied, converted), its version and copy."""
        self._n += 1
        draft = gguf = None
        if bundle is not None and Path(bundle).exists():
            version = served_version(Path(bundle)) or version
            draft = self._private_copy(Path(bundle), f"{self._n}-v{version or 'local'}")
            gguf = draft_gguf(draft, self.target_hf_dir, self.cache)
        cfg = replace(self.launch, draft_path=str(gguf) if gguf else None, port=port)
        srv = LlamaCppServer(cfg, self.state_dir / "logs" / f"llama-server-{self._n}.log",
                             ready_timeout_s=self.ready_timeout_s)
        srv.start()
        return srv, version if draft else None, draft

    def _serving(self, srv: LlamaCppServer, version: str | None, draft: Path | None) -> None:
        """`srv` serves `version` (its files: `draft`) now: a fresh server, whose counters are that
        version's alone."""
        self.server = srv
        self.served = ServedDraft(version, srv.url, draft)

    def scrape(self, url: str | None = None) -> SpecDecodeCounters | None:
        """The cumulative spec-decode counters of the server at `url` (default: the serving one;
        None: no server). Raises LlamaCppError when it does not answer."""
        url = url or (self.server.url if self.server else None)
        return scrape(url) if url else None


def _rss_mib(srv: LlamaCppServer | None) -> float:
    """Resident memory of `srv`'s process, MiB (0 when none or gone)."""
    proc = srv.server.proc if srv is not None else None
    try:
        return psutil.Process(proc.pid).memory_info().rss / 2**20 if proc is not None else 0.0
    except psutil.Error:
        return 0.0
