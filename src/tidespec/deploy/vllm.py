"""Deploy the champion into vLLM: a vLLM server behind the front door, swapped blue/green.

vLLM v0.32 has no runtime update of a draft's weights (its `/collective_rpc`-driven weight updates
reach the target model's worker only, and a draft is loaded once when the engine is built), so a new
champion gets a new server: start *green* on a free port with the new draft (its own copy of the
engine dir, so a later deploy cannot change files under it), wait for `/health`, send a canary
completion, switch the front door to green, wait until the requests still running on *blue* have
finished (`Proxy.inflight`), stop blue. Any failure before the switch stops green and leaves blue
serving: nothing is dropped, and the error names the log. Costs one engine's memory more (~4 GB for
SmolLM2 on CPU) for the duration of a swap.
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx

from ..adapters import process
from ..adapters.vllm import VLLMError, VLLMLaunch, VLLMServer
from ..workspace import DRAFT_FILES, engine_dir, private_dir, served_version

log = logging.getLogger(__name__)


class VLLMDeployment:
    """The vLLM server(s) serving `launch.model_path` behind `proxy` (a `frontdoor.Proxy`; None: no
    front door yet, `url` says where vLLM is). `state_dir`: private copies of deployed drafts and the
    servers' logs. `draft_version`: the registry version served (None: no draft or not from the
    registry), as `serve.admin.ChampionWatcher` expects of an engine."""

    def __init__(self, launch: VLLMLaunch, state_dir: Path, proxy=None, ready_timeout_s: float = 600.0,
                 drain_timeout_s: float = 300.0):
        self.launch, self.state_dir, self.proxy = launch, Path(state_dir), proxy
        self.ready_timeout_s, self.drain_timeout_s = ready_timeout_s, drain_timeout_s
        self.server: VLLMServer | None = None
        self.draft_version: str | None = None
        self._swap = threading.Lock()
        self._n = 0

    @property
    def url(self) -> str | None:
        return self.server.url if self.server else None

    def start(self, bundle: Path | None) -> VLLMDeployment:
        """Start serving the draft in `bundle` (a draft bundle or flat checkpoint; None or missing:
        the target alone). Raises VLLMError / VLLMUnavailable; nothing is left running then."""
        self.server, self.draft_version = self._launch(bundle, self.launch.port)
        return self

    def install(self, bundle: Path, version: str | None = None) -> dict:
        """Blue/green swap to the draft in `bundle` (module docstring). Returns {"draft_version",
        "url", "drained"}: drained False when blue still had requests after drain_timeout_s (it is
        stopped anyway). Raises VLLMError (green refused the draft, died, failed the canary): blue
        keeps serving."""
        with self._swap:
            green, version = self._launch(bundle, process.free_port(self.launch.host), version)
            try:
                canary(green.url, self.launch.served_model_name or self.launch.model_path)
            except BaseException:
                green.stop()
                raise
            blue, old = self.server, self.proxy.switch(green.url) if self.proxy else None
            self.server, self.draft_version = green, version
            drained = self._drain(old) if old else True
            if blue:
                blue.stop()
            log.info("vLLM now serves draft %s at %s (previous server stopped, drained=%s)", version, green.url, drained)
            return {"draft_version": version, "url": green.url, "drained": drained}

    def _launch(self, bundle: Path | None, port: int, version: str | None = None) -> tuple[VLLMServer, str | None]:
        self._n += 1
        draft = None
        if bundle is not None and Path(bundle).exists():
            version = served_version(Path(bundle)) or version
            draft = self._private_copy(Path(bundle), f"{self._n}-v{version or 'local'}")
        cfg = replace(self.launch, draft_path=str(draft) if draft else None, port=port)
        srv = VLLMServer(cfg, self.state_dir / "logs" / f"vllm-{self._n}.log", ready_timeout_s=self.ready_timeout_s)
        srv.start()
        return srv, version if draft else None

    def _private_copy(self, bundle: Path, name: str) -> Path:
        src = engine_dir(bundle)
        dest = private_dir(self.state_dir / "drafts") / name
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir()
        for f in DRAFT_FILES:
            if not (src / f).is_file():
                raise VLLMError(f"{bundle} is not a draft (no {f} in {src}); deploy a registry version there")
            shutil.copyfile(src / f, dest / f)
        return dest

    def _drain(self, url: str) -> bool:
        deadline = time.monotonic() + self.drain_timeout_s
        while self.proxy.inflight(url) > 0:
            if time.monotonic() > deadline:
                log.warning("%d requests still on %s after %g s: stopping it anyway", self.proxy.inflight(url), url,
                            self.drain_timeout_s)
                return False
            time.sleep(0.1)
        return True

    def close(self) -> None:
        """Stop the serving vLLM server (its whole process group)."""
        if self.server:
            self.server.stop()


def canary(url: str, model: str, timeout_s: float = 120.0) -> None:
    """A 1-token greedy completion on the vLLM server at `url`; raises VLLMError unless it answers
    200 with one choice."""
    try:
        r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 1,
                                                      "temperature": 0}, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise VLLMError(f"canary to {url} failed: {e}") from None
    if r.status_code != 200 or len(r.json().get("choices", [])) != 1:
        raise VLLMError(f"canary to {url} answered {r.status_code}: {r.text[:300]}")
