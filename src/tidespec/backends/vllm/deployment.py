"""Deploy the champion into vLLM: loaded in place into the running server, or blue/green.

**In place** (the default): the server runs vLLM's in-place reload of the draft's weights through a
worker extension (`backends/vllm/plugin/tidespec_draft_swap.py`, `backends.vllm.load_draft_in_place`),
between two engine steps, then resets its prefix cache; requests in flight continue, nothing is
started beside the server, and the memory is the new weights' once (what a GPU node running the
target at `gpu_memory_utilization` 0.9 can afford). It is refused, with the reason logged and
returned, when the new draft's config differs from the served one's (shapes, vocabulary, aux
layers: vLLM sized its buffers and KV cache for the first) or the server runs no draft.

**Blue/green** (the fallback): start *green* on a free port with the new draft (its own copy of the
engine dir), wait for `/health`, send a canary completion, switch the front door to green, wait
until the requests still running on *blue* have finished (`Proxy.inflight`), stop blue. Any failure
before the switch stops green and leaves blue serving. Costs one engine's memory more for the
duration of a swap (~4 GB for SmolLM2 on CPU).

Live figures per version: the server's cumulative spec-decode counters (`scrape`), less those it
had when the version was loaded (`VLLMDeployment.counters_base`; zero for a fresh server), which
`backends.live` logs and acts on. What serves is one `backends.base.ServedDraft`, replaced whole at a
swap (after the new counters base is read), so the reporter thread never sees a new version with
the old base.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

from ...adapters import process
from ...adapters.process import LOOPBACK
from ...workspace import served_version
from ..base import ServedDeployment, ServedDraft, drain
from ..base import canary as base_canary
from . import SpecDecodeCounters, VLLMError, VLLMLaunch, VLLMServer, load_draft_in_place, scrape

log = logging.getLogger(__name__)


class VLLMDeployment(ServedDeployment):
    """The vLLM server(s) serving `launch.model_path` behind `proxy` (a `frontdoor.Proxy`; None: no
    front door yet, `url` says where vLLM is). `state_dir`: private copies of deployed drafts and the
    servers' logs. `served`: what serves now (`backends.base.ServedDraft`); `draft_version`: its
    registry version, as `serve.admin.ChampionWatcher` expects of an engine."""

    error = VLLMError

    def __init__(self, launch: VLLMLaunch, state_dir: Path, proxy=None, ready_timeout_s: float = 600.0,
                 drain_timeout_s: float = 300.0, in_place: bool = True):
        self.launch, self.state_dir, self.proxy = launch, Path(state_dir), proxy
        self.ready_timeout_s, self.drain_timeout_s, self.in_place = ready_timeout_s, drain_timeout_s, in_place
        self.server: VLLMServer | None = None
        super().__init__("vLLM")

    def install(self, bundle: Path, version: str | None = None) -> dict:
        """Serve the draft in `bundle`: in place, else blue/green (module docstring). Returns
        {"draft_version", "url", "mode": "in_place" | "blue_green", "seconds"} plus, in place,
        "load_seconds" (the worker's) and, blue/green, "drained" (False when blue still had requests
        after drain_timeout_s; it is stopped anyway) and "in_place_refused" (why not in place).
        Raises VLLMError (the server refused the draft; green died or failed the canary): the
        served draft keeps serving."""
        with self._swap:
            t0 = time.perf_counter()
            version = served_version(Path(bundle)) or version
            draft = self._private_copy(Path(bundle), f"{self._n + 1}-v{version or 'local'}")
            why = self._in_place_refusal(draft)
            if why is None:
                return self._load_in_place(draft, version, t0)
            log.info("vLLM: draft %s goes blue/green, not in place: %s", version, why)
            return self._blue_green(bundle, version, t0) | {"in_place_refused": why}

    def reload(self) -> dict:
        """Load the served draft's own files into the server again, in place (prefix cache reset).
        Raises VLLMError (no draft served in place, or vLLM refused)."""
        with self._swap:
            if self.draft_dir is None or self.server is None or self.server.cfg.draft_swap_root is None:
                raise VLLMError("no draft served in place to reload")
            served, before = self._hide()
            try:
                res = load_draft_in_place(self.server.url, served.draft_dir)
            except BaseException:
                self.served = served
                raise
            self.served = replace(served, counters_base=self._counters() or before)
            log.info("vLLM reloaded draft %s in place in %.3f s", self.draft_version, res["seconds"])
            return res

    def _in_place_refusal(self, draft: Path) -> str | None:
        """Why `draft` cannot be loaded into the running server (None: it can)."""
        if not self.in_place:
            return "in-place swaps are off for this deployment"
        if self.server is None or self.draft_dir is None:
            return "the server runs no draft (started on the target alone)"
        if self.server.cfg.draft_swap_root is None:
            return "the server was started without draft_swap_root"
        return config_change(self.draft_dir, draft)

    def _load_in_place(self, draft: Path, version: str | None, t0: float) -> dict:
        served, before = self._hide()
        try:
            res = load_draft_in_place(self.server.url, draft)
        except VLLMError as e:  # a load that failed part-way: put the served draft's weights back
            self.served = served
            try:
                load_draft_in_place(self.server.url, served.draft_dir)
            except VLLMError as again:
                raise VLLMError(f"{e}; restoring the served draft {served.version} failed too ({again}): "
                                "restart the server") from None
            raise VLLMError(f"{e}; the served draft {served.version} was loaded again") from None
        except BaseException:
            self.served = served
            raise
        self._n += 1
        self.served = ServedDraft(version, served.url, draft, self._counters() or before)
        log.info("vLLM now serves draft %s at %s, loaded in place in %.3f s (prefix cache reset: %s)", version,
                 self.server.url, res["seconds"], res["reset_prefix_cache"])
        return {"draft_version": version, "url": self.server.url, "mode": "in_place",
                "seconds": time.perf_counter() - t0, "load_seconds": res["seconds"]}

    def _blue_green(self, bundle: Path, version: str | None, t0: float) -> dict:
        green, version = self._launch(bundle, process.free_port(self.launch.host), version)
        try:
            canary(green.url, self.launch.served_model_name or self.launch.model_path)
        except BaseException:
            green.stop()
            raise
        blue, old = self.server, self.proxy.switch(green.url) if self.proxy else None
        self._serving(green, version)
        drained = drain(self.proxy, old, self.drain_timeout_s, self.engine) if old else True
        if blue:
            blue.stop()
        log.info(
            "vLLM now serves draft %s at %s (previous server stopped, drained=%s)", version, green.url, drained
        )
        return {"draft_version": version, "url": green.url, "mode": "blue_green",
                "seconds": time.perf_counter() - t0, "drained": drained}

    def _launch(self, bundle: Path | None, port: int, version: str | None = None) -> tuple[VLLMServer, str | None]:
        self._n += 1
        draft = None
        if bundle is not None and Path(bundle).exists():
            version = served_version(Path(bundle)) or version
            draft = self._private_copy(Path(bundle), f"{self._n}-v{version or 'local'}")
        swap_root = str(draft.parent) if draft and self.in_place and self.launch.host in LOOPBACK else None
        cfg = replace(self.launch, draft_path=str(draft) if draft else None, port=port, draft_swap_root=swap_root)
        srv = VLLMServer(cfg, self.state_dir / "logs" / f"vllm-{self._n}.log", ready_timeout_s=self.ready_timeout_s)
        srv.start()
        return srv, version if draft else None

    def _serving(self, srv: VLLMServer, version: str | None) -> None:
        """`srv` serves `version` now: a fresh server, whose counters are that version's alone."""
        self.server = srv
        self.served = ServedDraft(version, srv.url, Path(srv.cfg.draft_path) if srv.cfg.draft_path else None)

    def scrape(self, url: str | None = None) -> SpecDecodeCounters | None:
        """The cumulative spec-decode counters of the server at `url` (default: the serving one;
        None: none exported, or no server). Raises VLLMError when it does not answer."""
        url = url or (self.server.url if self.server else None)
        return scrape(url) if url else None


def config_change(served: Path, new: Path) -> str | None:
    """How the draft config in `new` differs from the served one's in `served` (config.json, less
    tidespec's own bookkeeping: the warm start's path), or None when they are the same draft
    architecture, which an in-place load needs. E.g. "draft_vocab_size 64 → 128"."""
    def cfg(d: Path) -> dict:
        c = json.loads((d / "config.json").read_text())
        c.get("tidespec", {}).pop("warm_start", None)
        return c
    a, b = cfg(served), cfg(new)
    diff = [f"{k} {a.get(k)} → {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return "the draft's config changed: " + "; ".join(diff) if diff else None


def canary(url: str, model: str, timeout_s: float = 120.0) -> None:
    """A 1-token greedy completion on the vLLM server at `url`; raises VLLMError unless it answers
    200 with one choice (`backends.base.canary`)."""
    base_canary(url, model, VLLMError, timeout_s)
