"""The embedded engine's draft health on `tidespec serve`: what it reports (`HealthReport`) and what
the live guard reads from it (`EngineSource`).

Every `every_s` s, for each served draft — the generalist on each workload class it has drafted for,
a class's own draft on its class (`engine.health`): its live first-token acceptance against its
replayed one, and against the version served before it on the same class — each measured on the
traffic it served, so a report, never a verdict. /metrics:
`tidespec:draft_first_token_acceptance{version,workload,source}` (source live | replayed | previous)
and `tidespec:draft_regressed{version,workload,against}` (1 while clearly below; against replay |
previous); a warning log line when a verdict turns. Then the live guard's round (`serve.guard.LiveGuard`
over `EngineSource`: one track per (slot, class), its evidence `serve.judge.TeacherForced`), whose
rollbacks `tidespec:draft_rollbacks_total` counts. Classes are labelled as the request counters label
them (`ServeMetrics.label`: bounded). EAGLE-2 trees are not counted (`engine.health`): with
`engine.tree.eagle_topk > 1` greedy requests draft trees, which the report says once at start. The
off-switch for a draft that is not accepted is the goodput policy's (it predicts no gain and stops
drafting for the class).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from prometheus_client import Counter, Gauge

from ..engine.build import install_draft
from ..engine.health import Verdict
from ..engine.speculative import Engine
from .guard import Key, LiveGuard, Track
from .metrics import PREFIX, ServeMetrics
from .poller import Poller

log = logging.getLogger(__name__)


class EngineSource:
    """The live guard's view of the embedded engine (`serve.guard.GuardSource`): a track per (slot,
    class) — the generalist ("") on each class it drafted for, a class's own draft on its class —
    with the version's cumulative chain counters there (`DraftHealth.counters`) and its predecessor
    (`DraftHealth.previous`); `reload` / `install` put a registry version's checkpoint
    (`load_version(v)` → its dir) back into the slot through `install(path, version, workload)` (the
    server's `serve.admin.DraftInstaller`; default `engine.build.install_draft`); without
    `load_version` a reload cannot happen (False)."""

    def __init__(self, engine: Engine, load_version: Callable[[str], Path] | None = None,
                 install: Callable[..., dict] | None = None):
        self.engine, self.load_version = engine, load_version
        self._install = install or (lambda path, version, workload: install_draft(engine, path, version, workload))

    def tracks(self) -> dict[Key, Track]:
        h, out = self.engine.health, {}
        for slot, version in sorted(self.engine.draft_versions.items()):
            if version is not None:
                for w in h.classes(version) if not slot else [slot]:
                    out[(slot, w)] = Track(version, h.counters(version, w), h.previous(version))
        return out

    def reload(self, key: Key, version: str) -> bool:
        if self.load_version is None:
            return False
        self.install(key, version)
        return True

    def install(self, key: Key, version: str) -> None:
        if self.load_version is None:
            raise LookupError("no registry to fetch draft versions from")
        self._install(self.load_version(version), version, key[0])


class HealthReport(Poller):
    """See the module docstring. `guard`: the live guard run after each report (None: report only).
    `check()` runs one round and returns the verdicts that are clearly below (the thread calls it;
    tests call it directly); `every_s` ≤ 0 starts no thread."""

    what = "draft health check"

    def __init__(self, engine: Engine, metrics: ServeMetrics, every_s: float, guard: LiveGuard | None = None):
        self.engine, self.guard, self.label = engine, guard, metrics.label
        if engine.cfg.tree.eagle_topk > 1:
            log.info("draft health counts EAGLE3 chains: with engine.tree.eagle_topk %d greedy requests draft "
                     "trees, which it does not count", engine.cfg.tree.eagle_topk)
        r = metrics.registry
        self.acceptance = Gauge(f"{PREFIX}draft_first_token_acceptance", "First-token acceptance of the served "
                                "draft's EAGLE3 chains: live, replayed by its evaluation, or the previous version's "
                                "live.", ["version", "workload", "source"], registry=r)
        self.regressed = Gauge(f"{PREFIX}draft_regressed", "1 while the served draft's live first-token acceptance "
                               "is clearly below its replay or its predecessor's.", ["version", "workload", "against"],
                               registry=r)
        self.rollbacks = Counter(f"{PREFIX}draft_rollbacks", "Automatic rollbacks of a promoted draft.", registry=r)
        self._flagged: set[tuple[str, str, str]] = set()
        self._start(every_s, "tidespec-draft-health")

    def check(self) -> list[Verdict]:
        """One round: the report over every served draft, then the guard's round."""
        below = self.report()
        if self.guard is not None:
            self.rollbacks.inc(self.guard.check().count("rolled_back"))
        return below

    def report(self) -> list[Verdict]:
        """The gauges and log lines over every served draft (the generalist on the classes it drafted
        for, each class's own draft on its class); returns the verdicts that are clearly below."""
        h = self.engine.health
        self.acceptance.clear()
        self.regressed.clear()
        below, acc, reg = [], {}, {}
        for slot, version in sorted(self.engine.draft_versions.items()):
            if version is None:
                continue
            for w in h.classes(version) if not slot else [slot]:
                for against, v in (("replay", h.against_replay(version, w)),
                                   ("previous", h.against_previous(version, w))):
                    lw = self.label(v.workload)  # classes past the label bound share "other": its worst verdict
                    if v.live is not None:
                        acc[(version, lw, "live")] = v.live
                    if v.reference is not None:
                        acc[(version, lw, "replayed" if against == "replay" else "previous")] = v.reference
                    reg[(version, lw, against)] = max(reg.get((version, lw, against), 0.0), float(v.below))
                    self._log(v, against)
                    if v.below:
                        below.append(v)
        for labels, x in acc.items():
            self.acceptance.labels(*labels).set(x)
        for labels, x in reg.items():
            self.regressed.labels(*labels).set(x)
        return below

    def _log(self, v: Verdict, against: str) -> None:
        key = (v.version, v.workload, against)
        if v.below and key not in self._flagged:
            self._flagged.add(key)
            log.warning(v.line("its replayed acceptance" if against == "replay" else
                               f"v{self.engine.health.previous(v.version)}'s live acceptance"))
        elif not v.below and key in self._flagged:
            self._flagged.discard(key)
            log.info("draft v%s, class %r: first-token acceptance %.3f is no longer clearly below %s", v.version,
                     v.workload, v.live, against)
