"""What every serving backend offers the server, the champion watcher and the live guard
(`Backend`), and the served state its engine-server deployments share (`ServedDraft`,
`ServedDeployment`).

A deployment's `served` is one `ServedDraft`, replaced whole at each swap, never changed in place, so
a reader on another thread sees one consistent state (its `url` is None while weights are being
loaded in place); `scrape(url)` gives the cumulative `SpecDecodeCounters` of the server at `url`
(None when it exports none): its `/metrics` text (`metrics_text`), parsed by the engine's own
`parse_metrics` (vLLM's and llama.cpp's after one pattern: `parse_spec_decode`).
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from ..engine.spec_counters import SpecDecodeCounters
from ..errors import TidespecError
from ..workspace import copy_engine_files, private_dir

log = logging.getLogger(__name__)


def default_threads() -> int:
    """CPU threads an engine server gets when its launch names none: `$OMP_NUM_THREADS` (a positive
    integer), as the embedded engine's torch takes it, else every core (`os.cpu_count()`)."""
    try:
        return max(int(os.environ.get("OMP_NUM_THREADS", "")), 1)
    except ValueError:
        return os.cpu_count() or 1


class Backend(Protocol):
    """A serving engine tidespec drives: `install(bundle, version)` a draft version (returns what the
    swap did; raises TidespecError, ValueError or OSError and keeps the old one serving), the
    `draft_version` served (None: none, or not from the registry), `served` (its whole state), its
    live counters (`scrape()`), `reload()` of the served draft's own files, `close()`."""

    served: ServedDraft

    @property
    def draft_version(self) -> str | None: ...

    def install(self, bundle: Path, version: str | None = None) -> dict: ...

    def scrape(self, url: str | None = None) -> SpecDecodeCounters | None: ...

    def reload(self) -> dict: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ServedDraft:
    """What an engine server serves now, as one value: `version` (the registry version; None: no
    draft, or not from the registry), `url` (the server's base URL; None: not started), `draft_dir`
    (the private copy of the draft's engine files loaded; None: the target alone) and
    `counters_base` (the server's cumulative counters when this version was loaded in place; None: a
    fresh server, whose counters are the version's alone)."""
    version: str | None = None
    url: str | None = None
    draft_dir: Path | None = None
    counters_base: SpecDecodeCounters | None = None

    def own(self, now: SpecDecodeCounters | None) -> SpecDecodeCounters | None:
        """`now` (the server's cumulative counters) less `counters_base`: this version's own drafts."""
        return now - self.counters_base if now is not None and self.counters_base is not None else now


class EngineServer:
    """What a running engine server (`backends.vllm.VLLMServer`, `backends.llama_cpp.LlamaCppServer`)
    offers beside its own `start()`: its `url`, whether it is `running`, `stop()`, and use as a
    context manager (started on entry unless started already, stopped on exit). `cfg` (its launch,
    with a `url`) and `server` (its `adapters.process.ServerProcess`) are set by the subclass."""

    cfg = server = None

    def start(self):
        raise NotImplementedError

    @property
    def url(self) -> str:
        """The server's base URL (http://host:port)."""
        return self.cfg.url

    @property
    def running(self) -> bool:
        """True while the server process runs."""
        return self.server.running

    def stop(self) -> None:
        """Stop the server's whole process group (SIGTERM, SIGKILL after the grace period). Idempotent."""
        self.server.stop()

    def __enter__(self):
        return self.start() if self.server.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


class ServedDeployment:
    """What the deployments of an engine server (`backends.vllm.deployment`,
    `backends.sglang.deployment`) share: `served` (a
    `ServedDraft`) and its fields as the properties `serve.admin.ChampionWatcher` and the tests read,
    hiding it before an in-place load (`_hide`) and reading the counters at a swap (`_counters`),
    one swap at a time (`_swap`, a lock; `_n` numbers the private copies), the `server`
    (an `EngineServer`) serving now, its `url` and `close()`. Subclasses call
    `super().__init__(engine)` (its name, for logs) and define `scrape(url)`."""

    server: EngineServer | None = None
    error: type[Exception] = TidespecError  # the engine's own (VLLMError, LlamaCppError)

    def __init__(self, engine: str):
        self.engine = engine
        self.served = ServedDraft()
        self._swap = threading.Lock()
        self._n = 0

    def scrape(self, url: str | None = None) -> SpecDecodeCounters | None:
        raise NotImplementedError

    def start(self, bundle: Path | None):
        """Start serving the draft in `bundle` (a draft bundle or flat checkpoint; None or missing:
        the target alone) on the launch's port (the subclass's `_launch` and `_serving`); returns
        self. Raises the engine's errors (e.g. VLLMError / VLLMUnavailable); nothing is left running
        then."""
        self._serving(*self._launch(bundle, self.launch.port))
        return self

    @property
    def url(self) -> str | None:
        """Base URL of the engine server serving now (None before `start`)."""
        return self.server.url if self.server else None

    def close(self) -> None:
        """Stop the serving engine server (its whole process group)."""
        if self.server:
            self.server.stop()

    @property
    def draft_version(self) -> str | None:
        """The registry version served (None: no draft, or not from the registry)."""
        return self.served.version

    @property
    def draft_dir(self) -> Path | None:
        """The engine dir of the draft served now (None: the target alone)."""
        return self.served.draft_dir

    @property
    def counters_base(self) -> SpecDecodeCounters | None:
        """The server's counters when the served version was loaded in place (None: a fresh server)."""
        return self.served.counters_base

    def _private_copy(self, bundle: Path, name: str) -> Path:
        """The draft's engine files copied into `<state_dir>/drafts/<name>` (private: 0700); raises
        the engine's `error` naming a bundle without them."""
        dest = private_dir(self.state_dir / "drafts") / name
        shutil.rmtree(dest, ignore_errors=True)
        try:
            return copy_engine_files(bundle, dest)
        except FileNotFoundError as e:
            raise self.error(f"{e}; deploy a registry version there") from None

    def _hide(self) -> tuple[ServedDraft, SpecDecodeCounters | None]:
        """Before an in-place load: the served state and the server's counters now, the state
        published with url None meanwhile (no live figures while the weights change)."""
        served = self.served
        self.served = replace(served, url=None)
        return served, self._counters()

    def _counters(self) -> SpecDecodeCounters | None:
        """`scrape()`, None when the server does not answer: a metrics hiccup must not fail a swap
        (the counters read before the load stand in)."""
        try:
            return self.scrape()
        except TidespecError as e:
            log.warning("%s's counters unreadable at a swap: %s", self.engine, e)
            return None


def scrape_served(dep) -> tuple[ServedDraft, SpecDecodeCounters | None]:
    """`dep.served` and the counters of the server it names, read while it served that state
    (`dep.scrape(served.url)`): None while an in-place load runs (url None) or when a swap landed
    during the scrape (the state changed), never one version's drafts credited to another. Raises
    what `dep.scrape` raises (a blue server stopped by a blue/green swap)."""
    served = dep.served
    if served.url is None:
        return served, None
    now = dep.scrape(served.url)
    return served, (now if dep.served is served else None)




def metrics_text(url: str, engine: str, error: type[Exception], timeout_s: float = 10.0, client=None) -> str:
    """GET `<url>/metrics` of the `engine` server (its name, for the message) with `client` (default
    httpx); its text. Raises `error` when the server does not answer, or answers other than 200."""
    import httpx
    try:
        r = (client or httpx).get(f"{url.rstrip('/')}/metrics", timeout=timeout_s)
    except httpx.HTTPError as e:
        raise error(f"{engine} at {url} did not answer /metrics: {e}") from None
    if r.status_code != 200:
        raise error(f"{engine} at {url} answered /metrics with {r.status_code}")
    return r.text


def parse_spec_decode(text: str, prefix: str) -> SpecDecodeCounters | None:
    """The spec-decode counters of a `/metrics` exposition named after vLLM's (`v1/spec_decode/metrics.py`):
    `<prefix>num_drafts_total`, `..num_draft_tokens_total`, `..num_accepted_tokens_total` and
    `..num_accepted_tokens_per_pos_total{position}`, summed over their other label sets (several
    engines). vLLM's prefix is `vllm:spec_decode_`, llama.cpp's `llamacpp:spec_decode_`. None when
    the server exports no `num_drafts` (no speculation, or an older server): live τ is then unknown,
    never 0."""
    from prometheus_client.parser import text_string_to_metric_families
    vals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(prefix):
            continue
        for s in fam.samples:
            if not s.name.endswith("_total"):
                continue
            name = s.name.removeprefix(prefix).removesuffix("_total")
            if name == "num_accepted_tokens_per_pos":
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
            else:
                vals[name] = vals.get(name, 0.0) + s.value
    if "num_drafts" not in vals:
        return None
    pos = tuple(int(per_pos.get(i, 0)) for i in range(max(per_pos) + 1)) if per_pos else ()
    return SpecDecodeCounters(int(vals["num_drafts"]), int(vals.get("num_draft_tokens", 0)),
                              int(vals.get("num_accepted_tokens", 0)), pos)


def drain(proxy, url: str, timeout_s: float, engine: str) -> bool:
    """Wait until the front door `proxy` (a `serve.frontdoor.Proxy`) has no request left on `url`
    (a blue server after the switch to green): True, or False after `timeout_s` s (logged; the
    caller stops it anyway)."""
    deadline = time.monotonic() + timeout_s
    while proxy.inflight(url) > 0:
        if time.monotonic() > deadline:
            log.warning("%s: %d requests still on %s after %g s: stopping it anyway", engine, proxy.inflight(url),
                        url, timeout_s)
            return False
        time.sleep(0.1)
    return True


def canary(url: str, model: str, error: type[Exception], timeout_s: float = 120.0) -> None:
    """A 1-token greedy completion on the engine server at `url` (a green server before the switch);
    raises `error` unless it answers 200 with one choice."""
    import httpx
    try:
        r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 1,
                                                      "temperature": 0}, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise error(f"canary to {url} failed: {e}") from None
    if r.status_code != 200 or len(r.json().get("choices", [])) != 1:
        raise error(f"canary to {url} answered {r.status_code}: {r.text[:300]}")
