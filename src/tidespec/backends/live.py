"""Live acceptance behind a serving engine (vLLM: `backends.vllm`, SGLang: `backends.sglang`): the
served version's live figures logged to the registry (`report_live`), and acted on (`LiveGuard`:
reload in place, a switchback trial, then roll back), on a reporter thread (`LiveReporter`). The
deployments are `backends.base.Backend`s.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..adapters import registry
from ..engine.health import Z, paired_comparison
from ..errors import TidespecError
from .base import ServedDraft, scrape_served
from .spec_counters import SpecDecodeCounters, live_below_replay

# tune(per-position acceptance, drafts) → {profile: {"k", "predicted_speedup", ...}}: `steps.tuning.live_windows`
Tune = Callable[[list[float], int], dict]

log = logging.getLogger(__name__)


def report_live(dep, tracking_uri: str, target_id: str, tune: Tune | None = None) -> dict | None:
    """Scrape the serving engine's counters (`dep.scrape()`) and log them as the served version's live figures (MLflow
    run metrics `live/*`, step = drafts so far). A version whose live τ is clearly below the τ its
    evaluation replayed (`spec_counters.live_below_replay`) gets tag `live_tau_below_replay` = both
    figures and a warning naming them. With `tune` (the cycle's `steps.tuning.live_windows` over
    `deploy.sagemaker`: per endpoint profile, the window tuned again from the measured per-position
    acceptance, ≥ 100 drafts): tag `live_tuned_k.<profile>` (what `tidespec deploy sagemaker` then applies) and
    metric `live/predicted_speedup/<profile>`. Returns the logged metrics, or None when there is
    nothing to log: no registry version served, or no counters exported (live τ unknown, never 0)."""
    served, now = scrape_served(dep)
    version, live = served.version, served.own(now)  # loaded in place: the version's own drafts only
    if version is None or live is None or not live.num_drafts:
        return None
    m = {"acceptance_length": live.acceptance_length, "acceptance_rate": live.acceptance_rate,
         "num_drafts": live.num_drafts, "num_draft_tokens": live.num_draft_tokens,
         "num_accepted_tokens": live.num_accepted_tokens}
    m |= {f"accepted_per_pos/{i}": r for i, r in enumerate(live.per_position_rate)}
    windows = tune(list(live.per_position_rate), live.num_drafts) if tune else {}
    m |= {f"predicted_speedup/{p}": w["predicted_speedup"] for p, w in windows.items()}
    tags = {f"live_tuned_k.{p}": str(w["k"]) for p, w in windows.items()}
    replay_tau = registry.version_tags(tracking_uri, target_id, version).get("acceptance_length")
    if replay_tau is not None and live_below_replay(live, float(replay_tau)):
        tags["live_tau_below_replay"] = f"live {live.acceptance_length:.3f} < replayed {float(replay_tau):.3f}"
        log.warning("draft v%s: live τ %.3f (±%.3f, %d drafts) is clearly below its replayed τ %s", version,
                    live.acceptance_length, live.acceptance_length_se, live.num_drafts, replay_tau)
    registry.log_live(tracking_uri, target_id, version, m, live.num_drafts, tags)
    return m | {"flagged": "live_tau_below_replay" in tags, "live_tuned_k": {p: w["k"] for p, w in windows.items()}}


class LiveGuard:
    """Acts on live acceptance behind an engine server (vLLM, SGLang), one `check()` per round
    (`LiveReporter` calls it). A version is judged against figures measured on the traffic it
    serves, never against its replay (a holdout of other prompts: a shift of traffic would read
    as a broken draft).

    Windows: the served version's counters since the last judged window, once it holds `min_drafts`
    drafts. The version's first `reference_windows` windows are its **own reference** τ. Later
    windows are compared with it (`below_reference`: τ lower by more than z = 3 standard errors of
    the difference, both sides' SE). Hysteresis: `confirm` windows in a row below trigger an action,
    any window not below resets the count:
    1. **reload** the served draft in place (its own files again, prefix cache reset), once per
       version: what restores a draft that decayed or was corrupted while serving (vLLM #41838:
       acceptance decaying over hours, restored by a prefix-cache reset; SGLang PR #31674: draft
       weights lost after a memory release);
    2. still below after the reload — or, for a version just installed, its reference clearly below
       its predecessor's latest window (earlier traffic: a hint) —, with `rollback` wired and a
       previous version known: a **switchback trial** on the same traffic — the previous version and
       the current one served in turn, one window each, `trial_pairs` pairs in alternating order (P C,
       C P, P C: a linear drift of the traffic cancels over an even number of pairs, and shrinks to a
       third of one pair's over three), the champion watcher held meanwhile (`hold`, a
       `serve.admin.DraftPin`).
       Previous − current τ per pair, with both windows' SE (`engine.health.paired_comparison`):
       when the previous version is clearly better it is installed and `rollback(version, reason)`
       moves the registry (returns the restored version); otherwise the current version is installed
       again, kept (never trialled again) and its reference re-measured on today's traffic.
    A version restored by a rollback is never trialled (no cascade). Returns from `check()` the
    action taken ("reloaded", "trial", "rolled_back", "kept") or None."""

    def __init__(self, dep, rollback: Callable[[str, str], str | None] | None = None, hold=None,
                 min_drafts: int = 100, confirm: int = 2, reference_windows: int = 2, trial_pairs: int = 3,
                 z: float = Z):
        self.dep, self.rollback, self.hold = dep, rollback, hold
        self.min_drafts, self.confirm, self.reference_windows = min_drafts, confirm, reference_windows
        if trial_pairs < 2 or reference_windows < 1 or min_drafts < 1:
            raise ValueError("trial_pairs >= 2 (a verdict needs two pairs), reference_windows >= 1, min_drafts >= 1; "
                             f"got {trial_pairs}, {reference_windows}, {min_drafts}")
        self.trial_pairs, self.z = trial_pairs, z
        self._version: str | None = None
        self._start: SpecDecodeCounters | None = None
        self._ref_start: SpecDecodeCounters | None = None
        self._ref: SpecDecodeCounters | None = None
        self._ref_n = self._below = 0
        self._dirs: dict[str, Path | None] = {}  # version → its engine dir, as served
        self._previous: dict[str, str] = {}  # version → the version served before it (its first time)
        self._reloaded: set[str] = set()
        self._kept: set[str] = set()
        self._restored: set[str] = set()
        self._tried: set[str] = set()
        self._last: dict[str, SpecDecodeCounters] = {}  # version → its latest `reference_windows` windows
        self._marks: deque[SpecDecodeCounters] = deque(maxlen=reference_windows + 1)  # window boundaries
        self._trial: _Trial | None = None

    def check(self) -> str | None:
        served, now = scrape_served(self.dep)
        if served.version is None or now is None:
            return None
        if self._trial is not None:
            return self._trial_step(served, now)
        if served.version != self._version or self._start is None or now.num_drafts < self._start.num_drafts:
            self._serving(served, now)  # a new version, or a new server (blue/green: counters from 0)
            return None
        window = now - self._start
        if window.num_drafts < self.min_drafts:
            return None
        self._marks.append(now)
        self._last[served.version] = now - self._marks[0]  # its latest windows, pooled
        self._start = now
        if self._ref_n < self.reference_windows:
            self._ref_n += 1
            self._ref = now - self._ref_start
            return self._hint(served.version) if self._ref_n == self.reference_windows else None
        if not below_reference(window, self._ref, self.z):
            self._below = 0
            return None
        self._below += 1
        if self._below < self.confirm:
            return None
        self._below = 0
        reason = (f"live τ {window.acceptance_length:.3f} ± {window.acceptance_length_se:.3f} over the last "
                  f"{window.num_drafts} drafts, {self.confirm} windows in a row, clearly below its own τ "
                  f"{self._ref.acceptance_length:.3f} ± {self._ref.acceptance_length_se:.3f} "
                  f"({self._ref.num_drafts} drafts)")
        if served.version not in self._reloaded:
            self._reloaded.add(served.version)
            self.dep.reload()
            log.warning("reloaded draft %s in place: %s", served.version, reason)
            return "reloaded"
        return self._start_trial(served.version, f"{reason}, after a reload")

    def _serving(self, served: ServedDraft, now: SpecDecodeCounters, rebaseline: bool = False) -> None:
        """`served` is judged from `now` on: a new reference, measured over its next windows."""
        if not rebaseline and served.version != self._version:
            if self._version is not None and served.version not in self._dirs:
                self._previous[served.version] = self._version
            self._dirs.setdefault(served.version, served.draft_dir)
        self._version, self._start, self._ref_start, self._ref = served.version, now, now, None
        self._marks.clear()
        self._marks.append(now)
        self._ref_n = self._below = 0

    def _hint(self, version: str) -> str | None:
        """A new version's reference clearly below its predecessor's latest windows (measured on earlier
        traffic: a hint, not evidence) → a switchback trial; None otherwise."""
        prev = self._previous.get(version)
        last = self._last.get(prev) if prev is not None else None
        if last is None or not below_reference(self._ref, last, self.z):
            return None
        reason = (f"its first {self._ref.num_drafts} drafts' τ {self._ref.acceptance_length:.3f} is clearly below "
                  f"v{prev}'s latest {last.acceptance_length:.3f} (earlier traffic)")
        return self._start_trial(version, reason)

    def _start_trial(self, version: str, reason: str) -> str | None:
        prev = self._previous.get(version)
        if (self.rollback is None or prev is None or self._dirs.get(prev) is None
                or version in self._kept | self._restored | self._tried):
            return None
        self._tried.add(version)  # one trial per version, whatever its outcome (no endless alternation)
        arms = [a for j in range(self.trial_pairs) for a in ((prev, version) if j % 2 == 0 else (version, prev))]
        if self.hold is not None:
            self.hold.set(version, by=f"the live guard's switchback trial of draft {version}")
        self._trial = _Trial(version, prev, arms, reason)
        log.warning("draft %s: %s: switchback trial against v%s on the same traffic "
                    "(%d windows of %d drafts)", version, reason, prev, len(arms), self.min_drafts)
        try:
            self._install(prev)
        except Exception:  # the previous version cannot be served here: no trial, the current one serves on
            self._end_trial()
            log.exception("switchback trial of draft %s not started: v%s could not be installed", version, prev)
            return None
        return "trial"

    def _install(self, version: str) -> None:
        self._start = None  # no window spans a swap, even when the scrape after it fails
        if self.dep.served.version != version:
            self.dep.install(self._dirs[version], version)
        self._start = scrape_served(self.dep)[1]

    def _trial_step(self, served: ServedDraft, now: SpecDecodeCounters) -> str | None:
        t = self._trial
        if self._start is None or now.num_drafts < self._start.num_drafts:
            self._start = now
            return None
        window = now - self._start
        if window.num_drafts < self.min_drafts:
            return None
        if len(t.windows) >= len(t.arms):  # every window measured, the conclusion failed part-way: again
            return self._conclude(t)
        if served.version != t.arms[len(t.windows)]:  # something else installed a draft: no verdict
            log.warning("switchback trial of draft %s stopped: %s serves now", t.current, served.version)
            self._end_trial(served.version)
            self._serving(self.dep.served, now)
            return None
        t.windows.append(window)
        if len(t.windows) < len(t.arms):
            self._install(t.arms[len(t.windows)])
            return None
        return self._conclude(t)

    def _conclude(self, t: _Trial) -> str:
        diffs, variances = [], []
        for j in range(0, len(t.windows), 2):
            a, b = t.windows[j], t.windows[j + 1]
            p, c = (a, b) if t.arms[j] == t.previous else (b, a)
            diffs.append(p.acceptance_length - c.acceptance_length)
            variances.append(p.acceptance_length_se ** 2 + c.acceptance_length_se ** 2)
        cmp = paired_comparison(diffs, variances, self.z)
        line = cmp.line(t.current, t.previous, "window pairs (τ)")
        if cmp.previous_better:
            try:  # the pin is released once the registry moved, whatever fails (the watcher follows it then)
                self._install(t.previous)
                back = self.rollback(t.current, f"{t.reason}; switchback on the same traffic: {line}")
            finally:
                self._end_trial()
            self._restored.add(str(back or t.previous))
            log.warning("rolled back draft %s to %s: %s", t.current, back, line)
            self._serving(self.dep.served, scrape_served(self.dep)[1] or self._start)
            return "rolled_back"
        try:
            self._install(t.current)
        finally:
            self._end_trial()
        self._kept.add(t.current)
        log.warning("draft %s kept: not worse than v%s on the same traffic (%s); its reference is re-measured",
                    t.current, t.previous, line)
        self._serving(self.dep.served, self._start, rebaseline=True)
        return "kept"

    def _end_trial(self, version: str | None = None) -> None:
        self._trial = None
        if self.hold is not None:
            self.hold.set(None)


@dataclass
class _Trial:
    """A switchback trial in progress: the arms' versions in order, the windows measured so far."""
    current: str
    previous: str
    arms: list[str]
    reason: str
    windows: list[SpecDecodeCounters] = field(default_factory=list)


def below_reference(window: SpecDecodeCounters, reference: SpecDecodeCounters, z: float = Z) -> bool:
    """Is the window's τ clearly below the reference's (the same version's earlier windows)? τ_ref −
    τ_window > z · sqrt(SE_ref² + SE_window²): both sides' uncertainty (drafts independent)."""
    a, b = window.acceptance_length_se, reference.acceptance_length_se
    if a is None or b is None:
        return False
    return reference.acceptance_length - window.acceptance_length > z * (a * a + b * b) ** 0.5


class LiveReporter:
    """Calls `report_live` and then `guard.check()` (a `LiveGuard`, or None) every `every_s` seconds
    on a daemon thread; errors are logged, never raised."""

    def __init__(self, dep, tracking_uri: str, target_id: str, every_s: float = 60.0,
                 tune: Tune | None = None, guard: LiveGuard | None = None):
        self.args, self.every_s, self.guard = (dep, tracking_uri, target_id, tune), every_s, guard
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tidespec-live-acceptance", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                report_live(*self.args)
                if self.guard:
                    self.guard.check()
            except TidespecError as e:  # a server stopping (a swap, shutdown) between reading its URL and scraping it
                log.warning("live spec-decode figures not logged this time: %s", e)
            except Exception:  # a registry hiccup must not stop serving
                log.exception("live spec-decode figures not logged this time")

    def close(self) -> None:
        """Stop reporting (waits at most 5 s for a report in progress)."""
        self._stop.set()
        self._thread.join(5)
