"""The live guard: one rule for every backend that counts its drafts (the embedded engine, vLLM,
SGLang) — reload a draft that fell below its own live acceptance, roll back a version only when the
one it restores is measured better on the same traffic (`LiveGuard`).

A draft is never judged against its replay (a holdout of other prompts: a shift of traffic would
read as a broken draft). What the guard watches comes from a `GuardSource`: per track (a slot — ""
the generalist, or a workload class with its own draft — and the workload class judged), the
version served there and its cumulative spec-decode counters (`engine.spec_counters`); an engine
server has one track, the embedded engine one per (slot, class) (`serve.draft_health.EngineSource`,
`backends.live.ServerSource`). The evidence for a rollback is an `Evidence`: both versions served
in turn on the same windows (`serve.switchback.Switchback`, engine servers) or scored
teacher-forced on the same recent captured records (`serve.judge.TeacherForced`, the embedded
engine). The rule and its numbers: docs/serving.md ("Draft health and automatic rollback").
"""
from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from ..engine.health import PairedComparison
from ..engine.spec_counters import WINDOW_DRAFTS, SpecDecodeCounters, Z

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (slot: "" the generalist or a class's own draft, workload class judged)
NONE_YET = SpecDecodeCounters(0, 0, 0, ())
STOPPED = "stopped"  # an `Evidence.step` that ended without a verdict (another version was installed)
CONFIRM = 2  # windows in a row clearly below before the guard (and a canary's rollout) acts
REFERENCE_WINDOWS = 2  # a version's first windows: its own reference τ
# rollback(version, reason, slot) → the restored version (None: nothing rolled back); raises on failure
Rollback = Callable[[str, str, str], "str | None"]


@dataclass(frozen=True)
class Track:
    """What a source serves on one track: `version` (None: no registry draft), its cumulative
    `counters` since it was installed (None: none exported yet), and `previous` (the version served
    there before it, the first time it was; None: unknown, or the first)."""
    version: str | None
    counters: SpecDecodeCounters | None
    previous: str | None = None


class GuardSource(Protocol):
    """What the guard reads and drives: `tracks()` → {(slot, class): Track}; `reload(key, version)`
    the served draft's own files again (False: it cannot here); `install(key, version)` a version on
    a track (a switchback's arms; raises TidespecError, ValueError or OSError, the old one serving)."""

    def tracks(self) -> dict[Key, Track]: ...

    def reload(self, key: Key, version: str) -> bool: ...

    def install(self, key: Key, version: str) -> None: ...


class Evidence(Protocol):
    """A same-traffic comparison of two versions on a track: `begin` (False: cannot start), `step()`
    once per round until it returns a `PairedComparison` (previous − current τ; None: not yet;
    `STOPPED`: ended without one; `track`: the round's reading of the key), then
    `finish(key, previous_better)` (the winner left serving;
    raises when it cannot be installed); `abort(key)`: ended by another install, nothing installed.
    `what` names the comparison in the audit reason, `unit` what it pairs."""

    what: str
    unit: str

    def begin(self, key: Key, version: str, previous: str, reason: str) -> bool: ...

    def step(self, key: Key, track: Track) -> PairedComparison | str | None: ...

    def finish(self, key: Key, previous_better: bool) -> None: ...

    def abort(self, key: Key) -> None: ...


def below_reference(window: SpecDecodeCounters, reference: SpecDecodeCounters, z: float = Z) -> bool:
    """Is the window's τ clearly below the reference's (the same version's earlier windows)? τ_ref −
    τ_window > z · sqrt(SE_ref² + SE_window²): both sides' uncertainty (drafts independent)."""
    a, b = window.acceptance_length_se, reference.acceptance_length_se
    if a is None or b is None:
        return False
    return reference.acceptance_length - window.acceptance_length > z * (a * a + b * b) ** 0.5


@dataclass
class _State:
    """One track's version as the guard measures it: the current window's start, its own reference
    (its first windows), the windows in a row below it, the evidence under way (version, previous,
    reason)."""
    version: str | None
    start: SpecDecodeCounters | None
    ref_start: SpecDecodeCounters | None
    ref: SpecDecodeCounters | None = None
    ref_n: int = 0
    below: int = 0
    marks: deque = field(default_factory=deque)
    trial: tuple[str, str, str] | None = None


class LiveGuard:
    """Acts on live acceptance, one `check()` per round (the server's health poller, or
    `backends.live.LiveReporter`), per track of `source`.

    Windows: a track's counters since the last judged window, once they hold `min_drafts` drafts.
    A version's first `reference_windows` windows are its **own reference** τ; later windows are
    compared with it (`below_reference`, z = 3 with both sides' SE); `confirm` windows in a row
    below trigger an action, any window not below resets the count:
    1. **reload** the version's own files in place, once per version (what restores a draft that
       decayed or was corrupted while serving: vLLM #41838, SGLang PR #31674);
    2. still below after it — or a new version whose reference is clearly below its predecessor's
       latest windows on the class (earlier traffic: a hint) —, with `rollback` and `evidence` wired
       and a predecessor known: **evidence on the same traffic** (`Evidence`); when the previous
       version is clearly better (`PairedComparison.previous_better`), `rollback(version, reason,
       slot)` moves the registry (an audited decision; retried at the next check if it raises; None:
       the registry's champion moved on, nothing rolled back), else
       the version is kept (never tried again) and its reference re-measured on today's traffic.
    A version restored by a rollback is never tried (no cascade). `check()` returns the actions
    taken this round ("reloaded", "trial", "rolled_back", "kept"). Raises ValueError for
    reference_windows < 1 or min_drafts < 1."""

    def __init__(self, source: GuardSource, evidence: Evidence | None = None, rollback: Rollback | None = None,
                 min_drafts: int = WINDOW_DRAFTS, confirm: int = CONFIRM, reference_windows: int = REFERENCE_WINDOWS,
                 z: float = Z):
        if reference_windows < 1 or min_drafts < 1:
            raise ValueError(f"reference_windows >= 1 and min_drafts >= 1; got {reference_windows}, {min_drafts}")
        self.source, self.evidence, self.rollback = source, evidence, rollback
        self.min_drafts, self.confirm, self.reference_windows, self.z = min_drafts, confirm, reference_windows, z
        self._states: dict[Key, _State] = {}
        self._last: dict[tuple[str, str], SpecDecodeCounters] = {}  # (version, class) → its latest windows
        self._previous: dict[str, str] = {}  # version → the version served before it (its first time)
        self._reloaded: set[str] = set()
        self._tried: set[str] = set()
        self._kept: set[str] = set()
        self._restored: set[str] = set()
        self._pending: dict[str, tuple[str, str, str]] = {}  # version → (previous, reason, slot): to roll back

    @property
    def trying(self) -> bool:
        """Is evidence under way on any track?"""
        return any(st.trial is not None for st in self._states.values())

    def check(self) -> list[str]:
        """One round over every track; returns the actions taken."""
        actions = [a for a in (self._roll_back(v, *p) for v, p in list(self._pending.items())) if a]
        tracks = self.source.tracks()
        for key in [k for k, st in self._states.items() if k not in tracks]:  # a slot gone (a class draft removed)
            if self._states.pop(key).trial is not None:
                self.evidence.abort(key)
        for key, track in sorted(tracks.items()):
            a = self._step(key, track)
            if a:
                actions.append(a)
        return actions

    def _step(self, key: Key, track: Track) -> str | None:
        st = self._states.get(key)
        if st is not None and st.trial is not None:
            return self._trial_step(key, st, track)
        if st is None or track.version != st.version:
            self._serving(key, track)
            return None
        now = track.counters
        if now is None:
            return None
        if st.start is None:  # no counters when it was first seen: every draft counted since is its own
            st.start = st.ref_start = NONE_YET
            st.marks.append(NONE_YET)
        elif now.num_drafts < st.start.num_drafts:  # counted afresh (a restart, a reload in place): from here
            st.start = st.ref_start = now
            st.marks.clear()
            st.marks.append(now)
            return None
        window = now - st.start
        if st.version is None or window.num_drafts < self.min_drafts:
            return None
        st.marks.append(now)
        self._last[(st.version, key[1])] = now - st.marks[0]  # its latest windows, pooled
        st.start = now
        if st.ref_n < self.reference_windows:
            st.ref_n += 1
            st.ref = now - st.ref_start
            return self._hint(key, st) if st.ref_n == self.reference_windows else None
        if not below_reference(window, st.ref, self.z):
            st.below = 0
            return None
        st.below += 1
        if st.below < self.confirm:
            return None
        st.below = 0
        reason = (f"live τ {window.acceptance_length:.3f} ± {window.acceptance_length_se:.3f} over the last "
                  f"{window.num_drafts} drafts on {key[1] or 'all'!r} traffic, {self.confirm} windows in a row, "
                  f"clearly below its own τ {st.ref.acceptance_length:.3f} ± {st.ref.acceptance_length_se:.3f} "
                  f"({st.ref.num_drafts} drafts)")
        if st.version not in self._reloaded:
            self._reloaded.add(st.version)  # once per version, whether or not it could be reloaded
            if self._reload(key, st.version, reason):
                return "reloaded"
        return self._try(key, st, f"{reason}, after a reload")

    def _reload(self, key: Key, version: str, reason: str) -> bool:
        try:
            if not self.source.reload(key, version):
                return False
        except Exception:
            log.exception("reload of draft %s failed (%s); it is compared on the same traffic instead", version,
                          reason)
            return False
        log.warning("reloaded draft %s in place: %s", version, reason)
        return True

    def _serving(self, key: Key, track: Track) -> None:
        """`track`'s version is judged from its counters now on: a new reference over its next windows
        (its predecessor is the one it had the first time it served)."""
        if track.version is not None and track.previous is not None:
            self._previous.setdefault(track.version, track.previous)
        st = self._states[key] = _State(track.version, track.counters, track.counters)
        st.marks = deque([track.counters] if track.counters is not None else [], maxlen=self.reference_windows + 1)

    def _hint(self, key: Key, st: _State) -> str | None:
        """A new version's reference clearly below its predecessor's latest windows on the class
        (earlier traffic: a hint, not evidence) → evidence on the same traffic; None otherwise."""
        prev = self._previous.get(st.version)
        last = self._last.get((prev, key[1])) if prev is not None else None
        if last is None or not below_reference(st.ref, last, self.z):
            return None
        return self._try(key, st, f"its first {st.ref.num_drafts} drafts' τ {st.ref.acceptance_length:.3f} on "
                                  f"{key[1] or 'all'!r} traffic is clearly below v{prev}'s latest "
                                  f"{last.acceptance_length:.3f} (earlier traffic)")

    def _try(self, key: Key, st: _State, reason: str) -> str | None:
        prev, v = self._previous.get(st.version), st.version
        if (self.rollback is None or self.evidence is None or prev is None
                or v in self._kept | self._restored | self._tried | set(self._pending)):
            return None
        self._tried.add(v)  # once per version, whatever the outcome (no endless alternation)
        if not self.evidence.begin(key, v, prev, reason):
            return None
        st.trial = (v, prev, reason)
        log.warning("draft %s: %s: compared with v%s on the same traffic", v, reason, prev)
        return "trial"

    def _trial_step(self, key: Key, st: _State, track: Track) -> str | None:
        v, prev, reason = st.trial
        if track.version not in (v, prev):  # another version installed: no verdict
            self.evidence.abort(key)
            cmp = STOPPED
        else:
            cmp = self.evidence.step(key, track)
        if cmp is None:
            return None
        if not isinstance(cmp, PairedComparison):  # STOPPED: whatever serves now is measured afresh
            log.warning("comparison of draft %s with v%s stopped: %s serves now", v, prev,
                        track.version)
            self._serving(key, track)
            return None
        line, st.trial = cmp.line(v, prev, self.evidence.unit), None
        if cmp.previous_better:  # the registry decides even when the previous cannot be installed here
            self._pending[v] = (prev, f"{reason}; {self.evidence.what}: {line}", key[0])
        self._finish(key, v, cmp.previous_better)
        if cmp.previous_better:
            return self._roll_back(v, *self._pending[v])
        self._kept.add(v)
        log.warning("draft %s kept: not worse than v%s on the same traffic (%s); its reference is re-measured",
                    v, prev, line)
        self._serving(key, self.source.tracks().get(key) or Track(v, None))
        return "kept"

    def _finish(self, key: Key, version: str, previous_better: bool) -> None:
        try:  # the winner left serving
            self.evidence.finish(key, previous_better)
        except Exception:
            log.exception("after comparing draft %s, %s could not be left serving", version,
                          "the previous version" if previous_better else "it")

    def _roll_back(self, version: str, previous: str, reason: str, slot: str) -> str | None:
        try:
            back = self.rollback(version, reason, slot)
        except Exception as e:  # noqa: BLE001 - a registry hiccup must not stop serving
            log.error("rollback of v%s failed (retried at the next check): %s", version, e)
            return None
        del self._pending[version]
        if back is None:  # the registry's champion is another version now: nothing to roll back
            log.warning("draft %s not rolled back: the registry serves another champion now", version)
            return None
        self._restored.add(str(back))
        log.warning("rolled back draft %s%s to v%s: %s", version, f" (class {slot!r}'s draft)" if slot else "",
                    back, reason)
        return "rolled_back"
