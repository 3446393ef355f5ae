"""What every serving backend offers the server, the champion watcher and the live guard
(`Backend`), and the served state its engine-server deployments share (`ServedDraft`,
`ServedDeployment`).

A deployment's `served` is one `ServedDraft`, replaced whole at each swap, never changed in place, so
a reader on another thread sees one consistent state (its `url` is None while weights are being
loaded in place); `scrape(url)` gives the cumulative `SpecDecodeCounters` of the server at `url`
(None when it exports none).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from ..engine.spec_counters import SpecDecodeCounters
from ..errors import TidespecError

log = logging.getLogger(__name__)


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


class ServedDeployment:
    """What the deployments of an engine server (`backends.vllm.deployment`,
    `backends.sglang.deployment`) share: `served` (a
    `ServedDraft`) and its fields as the properties `serve.admin.ChampionWatcher` and the tests read,
    hiding it before an in-place load (`_hide`) and reading the counters at a swap (`_counters`),
    one swap at a time (`_swap`, a lock; `_n` numbers the private copies). Subclasses call
    `super().__init__(engine)` (its name, for logs) and define `scrape(url)`."""

    def __init__(self, engine: str):
        self.engine = engine
        self.served = ServedDraft()
        self._swap = threading.Lock()
        self._n = 0

    def scrape(self, url: str | None = None) -> SpecDecodeCounters | None:
        raise NotImplementedError

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


