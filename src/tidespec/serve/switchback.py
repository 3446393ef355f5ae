"""A switchback trial: the live guard's evidence behind an engine server (`Switchback`). The previous
version and the current one serve the same traffic in turn, one window each, and the paired
differences of their τ decide (`engine.health.paired_comparison`). Switchback (crossover) designs
for online experiments: Bojinov, Simchi-Levi & Zhao, "Design and Analysis of Switchback
Experiments", Management Science 2023, §2.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..engine.health import PairedComparison, Z, paired_comparison
from ..engine.spec_counters import SpecDecodeCounters
from .guard import STOPPED, GuardSource, Key

log = logging.getLogger(__name__)


@dataclass
class _Trial:
    """A trial in progress: the arms' versions in order, the windows measured so far."""
    current: str
    previous: str
    arms: list[str]
    start: SpecDecodeCounters | None = None
    windows: list[SpecDecodeCounters] = field(default_factory=list)


class Switchback:
    """`serve.guard.Evidence` by serving both versions on `source` (a track it can `install` on):
    `trial_pairs` pairs of `min_drafts`-draft windows in alternating order (P C, C P, P C: a linear
    drift of the traffic cancels over an even number of pairs, and shrinks to a third of one pair's
    over three), the champion watcher held meanwhile (`hold`, a `serve.admin.DraftPin`, released
    whatever happens). The comparison: previous − current τ per pair, each with both windows' SE.
    Raises ValueError for trial_pairs < 2 (a verdict needs two pairs) or min_drafts < 1."""

    what, unit = "switchback on the same traffic", "window pairs (τ)"

    def __init__(self, source: GuardSource, hold=None, min_drafts: int = 100, trial_pairs: int = 3, z: float = Z):
        if trial_pairs < 2 or min_drafts < 1:
            raise ValueError(f"trial_pairs >= 2 (a verdict needs two pairs), min_drafts >= 1; got {trial_pairs}, "
                             f"{min_drafts}")
        self.source, self.hold, self.min_drafts, self.trial_pairs, self.z = source, hold, min_drafts, trial_pairs, z
        self._trials: dict[Key, _Trial] = {}

    def begin(self, key: Key, version: str, previous: str, reason: str) -> bool:
        """Start serving `previous` (the first arm); False (logged, the pin released) when it cannot be installed."""
        pair = (previous, version)
        arms = [a for j in range(self.trial_pairs) for a in (pair if j % 2 == 0 else pair[::-1])]
        if self.hold is not None:
            self.hold.set(version, by=f"the live guard's switchback trial of draft {version}")
        t = self._trials[key] = _Trial(version, previous, arms)
        log.warning("draft %s: switchback trial against v%s on the same traffic (%d windows of %d drafts)",
                    version, previous, len(arms), self.min_drafts)
        try:
            self._install(key, t, previous)
        except Exception:  # the previous version cannot be served here: no trial, the current one serves on
            self._end(key)
            log.exception("switchback trial of draft %s not started: v%s could not be installed", version, previous)
            return False
        return True

    def step(self, key: Key, track) -> PairedComparison | str | None:
        """One round: close the arm's window once it holds `min_drafts` drafts and install the next arm;
        the comparison after the last one; `STOPPED` when something else installed a draft."""
        t, now = self._trials[key], track.counters
        if now is None or t.start is None or now.num_drafts < t.start.num_drafts:
            t.start = now
            return None
        window = now - t.start
        if window.num_drafts < self.min_drafts:
            return None
        if track.version != t.arms[len(t.windows)]:
            log.warning("switchback trial of draft %s stopped: %s serves now", t.current, track.version)
            self._end(key)
            return STOPPED
        t.windows.append(window)
        if len(t.windows) < len(t.arms):
            self._install(key, t, t.arms[len(t.windows)])
            return None
        diffs, variances = [], []
        for j in range(0, len(t.windows), 2):
            a, b = t.windows[j], t.windows[j + 1]
            p, c = (a, b) if t.arms[j] == t.previous else (b, a)
            diffs.append(p.acceptance_length - c.acceptance_length)
            variances.append(p.acceptance_length_se ** 2 + c.acceptance_length_se ** 2)
        return paired_comparison(diffs, variances, self.z)

    def finish(self, key: Key, previous_better: bool) -> None:
        """Leave the winner serving and release the watcher (whatever the install does)."""
        t = self._trials[key]
        try:
            self._install(key, t, t.previous if previous_better else t.current)
        finally:
            self._end(key)

    def abort(self, key: Key) -> None:
        """Another version was installed: the trial ends, nothing installed, the watcher released."""
        self._end(key)

    def _install(self, key: Key, t: _Trial, version: str) -> None:
        t.start = None  # no window spans a swap, even when the scrape after it fails
        track = self.source.tracks().get(key)
        if track is None or track.version != version:
            self.source.install(key, version)
            track = self.source.tracks().get(key)
        t.start = track.counters if track is not None else None

    def _end(self, key: Key) -> None:
        self._trials.pop(key, None)
        if self.hold is not None:
            self.hold.set(None)
