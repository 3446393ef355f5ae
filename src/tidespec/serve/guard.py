"""The draft-health guard of `tidespec serve`: reports a draft that is no longer accepted as its
evaluation said, and rolls back a promotion that made live acceptance clearly worse.

Every `every_s` s, for each served draft — the generalist on each workload class it has drafted for,
a class's own draft on its class (`engine.health`):
its live first-token acceptance against its replayed one, and against the version served before it
on the same class — measured on the traffic each served, so a hint, not evidence. /metrics:
`tidespec:draft_first_token_acceptance{version,workload,source}`
(source live | replayed | previous) and `tidespec:draft_regressed{version,workload,against}` (1 while
clearly below; against replay | previous); a warning log line when a verdict turns. A version clearly
below its predecessor is then scored against it on the same recent traffic (`judge`, a
`serve.judge.PairedJudge`: both drafts teacher-forced on the class's newest captured records); only
when the predecessor is clearly better there does it call `rollback(version, reason)` (a class's own
draft: `rollback(version, reason, workload)`), once (the server wires it to the registry:
an audited `rolled_back` decision and the restored champion deployed where the champion watcher
picks it up; `tidespec:draft_rollbacks_total` counts them). Classes are labelled as the request
counters label them (`ServeMetrics.label`: bounded). EAGLE-2 trees are not counted (`engine.health`):
with `engine.tree.eagle_topk > 1` greedy requests draft trees, which the guard says once at start.
The off-switch for a draft that is not accepted is the goodput policy's (it predicts no gain and
stops drafting for the class).
"""
from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client import Counter, Gauge

from ..engine.health import PairedComparison, Verdict
from ..engine.speculative import Engine
from .metrics import PREFIX, ServeMetrics
from .poller import Poller

log = logging.getLogger(__name__)


class HealthGuard(Poller):
    """See the module docstring. `rollback(version, reason)`: None = report only. `check()` runs one
    round (the thread calls it; tests call it directly); `every_s` ≤ 0 starts no thread."""

    what = "draft health check"

    def __init__(self, engine: Engine, metrics: ServeMetrics, every_s: float,
                 rollback: Callable[[str, str], None] | None = None,
                 judge: Callable[[str, str, str], PairedComparison | None] | None = None):
        self.engine, self.rollback, self.judge, self.label = engine, rollback, judge, metrics.label
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
        self._rolled: set[str] = set()
        self._judged: dict[tuple[str, str], PairedComparison | None] = {}  # (version, class) → its verdict
        self._start(every_s, "tidespec-draft-health")

    def check(self) -> list[Verdict]:
        """One round over every served draft (the generalist on the classes it drafted for, each class's
        own draft on its class); returns the verdicts that are clearly below."""
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
                    self._report(v, against)
                    if v.below:
                        below.append(v)
                        if against == "previous":
                            self._roll_back(v, slot)
        for labels, x in acc.items():
            self.acceptance.labels(*labels).set(x)
        for labels, x in reg.items():
            self.regressed.labels(*labels).set(x)
        return below

    def _report(self, v: Verdict, against: str) -> None:
        key = (v.version, v.workload, against)
        if v.below and key not in self._flagged:
            self._flagged.add(key)
            log.warning(v.line("its replayed acceptance" if against == "replay" else
                               f"v{self.engine.health.previous(v.version)}'s live acceptance"))
        elif not v.below and key in self._flagged:
            self._flagged.discard(key)
            log.info("draft v%s, class %r: first-token acceptance %.3f is no longer clearly below %s", v.version,
                     v.workload, v.live, against)

    def _roll_back(self, v: Verdict, slot: str = "") -> None:
        if self.rollback is None or v.version in self._rolled:
            return
        prev = self.engine.health.previous(v.version)
        cmp = self._compare(v.version, prev, v.workload)
        if cmp is None or not cmp.previous_better:
            return
        reason = (f"live first-token acceptance of v{v.version} on {v.workload!r} traffic {v.live:.3f} "
                  f"(~{v.chains:.0f} chains) clearly below v{prev}'s {v.reference:.3f}, and on the same recent "
                  f"traffic, teacher-forced, v{prev} is clearly better: "
                  f"{cmp.line(v.version, prev, 'records (τ, teacher-forced)')}")
        try:
            self.rollback(v.version, reason, slot) if slot else self.rollback(v.version, reason)
        except Exception as e:  # noqa: BLE001 - a registry hiccup must not stop serving
            log.error("rollback of v%s failed (it keeps serving; retried at the next check): %s", v.version, e)
            return
        self._rolled.add(v.version)
        self.rollbacks.inc()
        log.warning("rolled back v%s%s: %s", v.version, f" (class {slot!r}'s draft)" if slot else "", reason)

    def _compare(self, version: str, prev: str, workload: str) -> PairedComparison | None:
        """The paired verdict of (version, class), scored once (`judge`; None: no evidence yet, asked
        again at the next check). A version kept is logged once with its figures."""
        key = (version, workload)
        if self._judged.get(key) is None:
            cmp = self.judge(version, prev, workload) if self.judge is not None else None
            if cmp is None:
                return None
            self._judged[key] = cmp
            if not cmp.previous_better:
                log.warning("draft v%s on %r: below v%s's earlier live acceptance, but not worse on the same "
                            "recent traffic (%s): kept", version, workload, prev,
                            cmp.line(version, prev, "records (τ, teacher-forced)"))
        return self._judged[key]
