"""The live guard behind an engine server (`backends.live.server_guard`: `serve.guard.LiveGuard` with
a `serve.switchback.Switchback`) on simulated counters: a
version judged against its own earlier windows, a reload for a corrupted draft, and a rollback only
when a switchback trial on the same traffic finds the previous version clearly better
(`engine.health.paired_comparison`). The same guard against a real vLLM runs in test_vllm_real.

Traffic is simulated per draft: k = 3 chained drafts, each accepted with a constant conditional
probability p (so τ = 1 + p + p² + p³) that depends on the version served and on the traffic.
Replay of the reported scenario (a coding workload the drafts were not adapted to): v2, adapted on
other prompts (p 0.45 there, τ 1.86), loses acceptance when the traffic shifts and is then as good
as v1, the static, on it (p 0.195 both, τ 1.23)."""
import random

import pytest

from tidespec.backends.base import ServedDraft
from tidespec.backends.live import server_guard
from tidespec.engine.health import PairedComparison, paired_comparison
from tidespec.engine.spec_counters import SpecDecodeCounters
from tidespec.serve.admin import DraftPin
from tidespec.serve.guard import LiveGuard, Track, below_reference

K = 3


class SimulatedServer:
    """A deployment (`served`, `scrape`, `install`, `reload`) whose counters grow by `round()`:
    `drafts` drafts of the served version on the current `traffic` (p = rates[(version, traffic)])."""

    def __init__(self, rates: dict, seed: int, version: str = "1"):
        self.rates, self.rng, self.traffic, self.corrupt = rates, random.Random(seed), "old", False
        self.counts = [0, 0, 0, (0,) * K]
        self.served = ServedDraft(version, "http://sim", f"/drafts/{version}")
        self.installs: list[str] = []
        self.reloads = 0

    def round(self, drafts: int = 120) -> None:
        p = 0.02 if self.corrupt else self.rates[(self.served.version, self.traffic)]
        per_pos = list(self.counts[3])
        acc = 0
        for _ in range(drafts):
            run = 0
            while run < K and self.rng.random() < p:
                per_pos[run] += 1
                run += 1
            acc += run
        self.counts = [self.counts[0] + drafts, self.counts[1] + K * drafts, self.counts[2] + acc, tuple(per_pos)]

    def scrape(self, url=None) -> SpecDecodeCounters:
        return SpecDecodeCounters(*self.counts)

    def install(self, bundle, version=None) -> dict:
        self.installs.append(version)
        self.served = ServedDraft(version, "http://sim", bundle)
        return {"draft_version": version, "mode": "in_place"}

    def reload(self) -> dict:
        self.reloads += 1
        self.corrupt = False
        return {"seconds": 0.0}


def run_scenario(rates: dict, seed: int, rounds: int = 40, corrupt_at: int | None = None):
    """v1 serves the old traffic, v2 is deployed, the traffic shifts after v2's reference windows.
    Returns (actions, rollbacks, the server)."""
    dep = SimulatedServer(rates, seed)
    rolled, hold = [], DraftPin()

    def rollback(version, reason, slot):
        rolled.append((version, reason))
        return "1"
    guard = server_guard(dep, rollback, hold)
    actions = []
    for i in range(rounds):
        if i == 4:
            dep.install("/drafts/2", "2")  # the cycle promotes v2 (the watcher installs it)
        if i == 9:
            dep.traffic = "new"  # prompts of another kind: every draft is accepted less
        if corrupt_at is not None and i == corrupt_at:
            dep.corrupt = True
        dep.round()
        actions += guard.check() or [None]
        if not guard.trying:
            assert hold.version is None  # the watcher is held only while a trial runs
        else:
            assert hold.version == "2" and "switchback" in hold.by
    return actions, rolled, dep


SHIFT = {("1", "old"): 0.195, ("1", "new"): 0.195, ("2", "old"): 0.45, ("2", "new"): 0.195}


def test_a_shift_of_traffic_is_judged_on_the_same_traffic_and_kept():
    actions, rolled, dep = run_scenario(SHIFT, seed=0)
    assert actions.count("reloaded") == 1 and actions.count("trial") == 1 and actions.count("kept") == 1
    assert rolled == [] and dep.served.version == "2"
    assert dep.installs == ["2", "1", "2", "1", "2"]  # the cycle, then arms 1 2 | 2 1 | 1 2 (a swap where they change)
    assert actions[-10:] == [None] * 10  # re-measured on today's traffic: quiet afterwards


def test_false_rollbacks_on_a_replay_of_the_shift_and_power_against_a_worse_draft():
    """Over 200 seeds of the replayed scenario (v2 as good as v1 on the new traffic, or better: p 0.245,
    τ 1.32), the z = 3 paired test rolls back at most 2 (its one-sided false rate is ~0.13 % per trial,
    the sample-SE floor makes it rarer; P(> 2 of 200) < 0.3 % at that rate); the guard it replaces
    rolled back every time. A worse v2 (p 0.02 on the new traffic) is rolled back in ≥ 195 of 200."""
    better = SHIFT | {("2", "new"): 0.245}
    worse = SHIFT | {("2", "new"): 0.02}
    false = sum(bool(run_scenario(r, seed)[1]) for seed in range(100) for r in (SHIFT, better))
    caught = sum(bool(run_scenario(worse, seed)[1]) for seed in range(200))
    assert false <= 2 and caught >= 195, (false, caught)


def test_a_corrupted_draft_is_reloaded_and_recovers_without_a_trial():
    actions, rolled, dep = run_scenario(SHIFT | {("2", "new"): 0.45}, seed=1, corrupt_at=14)
    assert actions.count("reloaded") == 1 and dep.reloads == 1 and "trial" not in actions and rolled == []


def test_a_worse_draft_is_rolled_back_with_the_paired_figures():
    actions, rolled, dep = run_scenario(SHIFT | {("2", "new"): 0.02}, seed=2)
    assert actions.count("rolled_back") == 1 and dep.served.version == "1"
    assert rolled[0][0] == "2" and "switchback on the same traffic: v1 − v2 = +" in rolled[0][1]


def test_below_reference_counts_both_sides_uncertainty():
    ref = SpecDecodeCounters(400, 1200, 400, (200, 120, 80))  # τ 2.0
    low = SpecDecodeCounters(100, 300, 60, (40, 15, 5))  # τ 1.6
    se = (ref.acceptance_length_se ** 2 + low.acceptance_length_se ** 2) ** 0.5
    assert below_reference(low, ref) == (0.4 > 3 * se) and below_reference(low, ref)
    assert not below_reference(ref, ref)


def test_paired_comparison_uses_known_and_sample_variance():
    c = paired_comparison([0.3, 0.3, 0.3], [0.01, 0.01, 0.01])
    assert c.se == pytest.approx(0.03 ** 0.5 / 3) and c.previous_better  # 0.3 > 3 × 0.0577
    c = paired_comparison([0.5, -0.3, 0.4], [0.0001] * 3)  # the windows disagree: the sample SE rules
    assert c.se == pytest.approx((sum((d - 0.2) ** 2 for d in (0.5, -0.3, 0.4)) / 2 / 3) ** 0.5)
    assert not c.previous_better and not paired_comparison([1.0]).previous_better  # one pair: no verdict
    with pytest.raises(ValueError, match="3 differences but 2 variances"):
        paired_comparison([1, 2, 3], [1, 1])


def test_a_draft_worse_from_its_first_window_is_trialled_and_rolled_back():
    """v2 bad from the start (its own reference is low): its first windows, clearly below v1's latest,
    start a trial at once (no reload: nothing decayed), which rolls it back; a v2 as good as v1 on the
    same new traffic, installed as the traffic shifts, goes through the same trial and is kept."""
    for p2, outcome in ((0.02, "rolled_back"), (0.195, "kept")):
        rates = {("1", "old"): 0.45, ("1", "new"): 0.195, ("2", "new"): p2}
        dep, rolled = SimulatedServer(rates, seed=3), []
        guard = server_guard(dep, lambda v, why, slot, out=rolled: out.append(v) or "1", DraftPin())
        actions = []
        for i in range(30):
            if i == 4:
                dep.traffic = "new"
                dep.install("/drafts/2", "2")
            dep.round()
            actions += guard.check() or [None]
        assert "reloaded" not in actions and actions.count("trial") == 1 and actions.count(outcome) == 1, actions
        assert rolled == (["2"] if outcome == "rolled_back" else [])


def test_a_failed_install_releases_the_watcher_and_a_failed_rollback_is_retried():
    """The previous version cannot be installed (a blue/green swap without the memory): no trial, the
    pin released, the current version keeps serving. A rollback whose registry call fails: the pin is
    released all the same, the version is not trialled again (no endless alternation) and the
    rollback is retried at the next checks."""
    class NoPrevious(SimulatedServer):
        def install(self, bundle, version=None):
            if version == "1" and self.installs:
                raise RuntimeError("no memory for a second server")
            return super().install(bundle, version)

    def rounds(dep, guard, hold, n):
        """The scenario's rounds (v2 at round 4, the shift at 9); each check's action ("failed": raised)."""
        out = []
        for i in range(n):
            if i == 4:
                dep.install("/drafts/2", "2")
            if i == 9:
                dep.traffic = "new"
            dep.round()
            out += guard.check() or [None]
            assert not guard.trying or hold.version == "2"  # held only while a trial runs
        return out

    worse = SHIFT | {("2", "new"): 0.02}
    dep, hold = NoPrevious(worse, seed=4), DraftPin()
    actions = rounds(dep, server_guard(dep, lambda v, why, slot: "1", hold), hold, 30)
    assert set(actions) <= {None, "reloaded"} and hold.version is None
    assert dep.served.version == "2" and dep.installs == ["2"]

    calls = []

    def failing(version, reason, slot):
        calls.append(version)
        if len(calls) < 3:
            raise RuntimeError("registry down")
        return "1"
    dep, hold = SimulatedServer(worse, seed=5), DraftPin()
    actions = rounds(dep, server_guard(dep, failing, hold), hold, 40)
    # the trial's verdict stands: the rollback is retried at the next checks until the registry answers
    assert actions.count("trial") == 1 and calls == ["2", "2", "2"] and actions.count("rolled_back") == 1
    assert hold.version is None
    with pytest.raises(ValueError, match="trial_pairs >= 2"):
        server_guard(dep, failing, trial_pairs=1)


# --- the ladder on a scripted source: one track, windows of 100 drafts at given per-position rates ---

TRACK = ("", "chat")
HIGH, MID, LOW = (0.7, 0.4, 0.1), (0.4, 0.15, 0.05), (0.1, 0.0, 0.0)  # τ 2.2, 1.6, 1.1
BETTER = PairedComparison(0.5, 0.05, 10)  # the previous version clearly better
EQUAL = PairedComparison(0.0, 0.05, 10)


class ScriptedSource:
    """A `GuardSource` whose track the test sets; reloads and installs are recorded (or raise)."""

    def __init__(self, reload_error: Exception | None = None):
        self.track, self.reloads, self.installs, self.reload_error = None, [], [], reload_error

    def tracks(self):
        return {TRACK: self.track} if self.track else {}

    def reload(self, key, version):
        self.reloads.append(version)
        if self.reload_error:
            raise self.reload_error
        return True

    def install(self, key, version):
        self.installs.append(version)


class ScriptedEvidence:
    """An `Evidence` that answers the verdicts given, in order (None: not yet); `finish` may raise."""

    what, unit = "scripted", "pairs"

    def __init__(self, verdicts=(), finish_error: Exception | None = None):
        self.verdicts, self.finish_error = list(verdicts), finish_error
        self.begun, self.finished, self.aborted = [], [], []

    def begin(self, key, version, previous, reason):
        self.begun.append(version)
        return True

    def step(self, key, track):
        return self.verdicts.pop(0) if self.verdicts else None

    def finish(self, key, previous_better):
        self.finished.append(previous_better)
        if self.finish_error:
            raise self.finish_error

    def abort(self, key):
        self.aborted.append(key)


def serve(guard, src, version, windows, previous=None, start=None, size=100):
    """`version` serves `windows` (per-position rates, one window of `size` drafts per check) from
    counters `start` (its own since installed: zero); returns the actions and the counters."""
    c = start or SpecDecodeCounters(0, 0, 0, (0, 0, 0))
    src.track = Track(version, c, previous)
    actions = guard.check()
    for rates in windows:
        per = tuple(a + int(size * r) for a, r in zip(c.accepted_per_pos, rates))
        c = SpecDecodeCounters(c.num_drafts + size, c.num_draft_tokens + 3 * size,
                               c.num_accepted_tokens + sum(int(size * r) for r in rates), per)
        src.track = Track(version, c, previous)
        actions += guard.check()
    return actions, c


def test_the_window_rule_needs_confirmation_a_pooled_reference_and_z():
    src = ScriptedSource()
    assert serve(LiveGuard(src, ScriptedEvidence(), lambda *a: "0"), src, "1", [HIGH, HIGH, LOW])[0] == []  # one below
    assert serve(LiveGuard(src, ScriptedEvidence(), lambda *a: "0"), src, "1",
                 [HIGH, HIGH, LOW, HIGH, LOW, HIGH, LOW])[0] == []  # a window not below resets the count
    # the reference pools its first windows: τ (2.2 + 1.6) / 2 = 1.9, which MID windows are clearly below
    assert serve(LiveGuard(src, ScriptedEvidence(), lambda *a: "0"), src, "1", [HIGH, MID, MID, MID],
                 size=1000)[0] == ["reloaded"]
    ref = SpecDecodeCounters(400, 1200, 400, (200, 120, 80))
    w = SpecDecodeCounters(100, 300, 85, (45, 25, 15))  # τ 1.85: 0.15 below, between 1 and 3 SE of the difference
    se = (ref.acceptance_length_se ** 2 + w.acceptance_length_se ** 2) ** 0.5
    assert se < 0.15 < 3 * se and not below_reference(w, ref) and below_reference(w, ref, z=1)


def test_counters_counted_afresh_restart_the_windows():
    """A reload in place (or a restart) starts the version's own counters at 0 again: windows restart
    from there, never a negative window."""
    src = ScriptedSource()
    guard = LiveGuard(src, ScriptedEvidence(), lambda *a: "0")
    _, c = serve(guard, src, "1", [HIGH] * 5)
    assert serve(guard, src, "1", [LOW, LOW], start=c)[0][-1:] == ["reloaded"]
    actions, _ = serve(guard, src, "1", [LOW, LOW, LOW])  # counted from 0 again: the first check re-bases
    # two windows below again (reloaded once per version already; no predecessor to compare with), a third
    assert actions == [] and guard._states[TRACK].below == 1 and src.reloads == ["1"]


def test_a_version_is_compared_once_and_a_restored_one_never():
    src, ev = ScriptedSource(), ScriptedEvidence([BETTER])
    guard = LiveGuard(src, ev, lambda v, why, slot: "1")
    serve(guard, src, "1", [HIGH] * 3)
    assert serve(guard, src, "2", [LOW] * 4, previous="1")[0] == ["trial", "rolled_back"]
    serve(guard, src, "1", [HIGH, HIGH] + [LOW] * 8)  # restored, then worse than its own reference
    assert ev.begun == ["2"] and src.reloads == ["1"]  # reloaded, never compared again (no cascade)


def test_a_reload_that_fails_goes_on_to_the_comparison():
    src, ev = ScriptedSource(RuntimeError("vLLM refused the load")), ScriptedEvidence([BETTER])
    guard = LiveGuard(src, ev, lambda v, why, slot: "1")
    serve(guard, src, "1", [HIGH] * 3)
    actions, _ = serve(guard, src, "2", [HIGH, HIGH] + [LOW] * 6, previous="1")
    assert src.reloads == ["2"] and actions == ["trial", "rolled_back"]


def test_a_previous_version_that_cannot_be_installed_is_still_restored_through_the_registry():
    src, ev, rolled = ScriptedSource(), ScriptedEvidence([BETTER], RuntimeError("no memory")), []
    guard = LiveGuard(src, ev, lambda v, why, slot: rolled.append(v) or "1")
    serve(guard, src, "1", [HIGH] * 3)
    assert serve(guard, src, "2", [LOW] * 4, previous="1")[0] == ["trial", "rolled_back"]
    assert ev.finished == [True] and rolled == ["2"]


def test_a_registry_that_moved_on_is_not_a_rollback():
    src = ScriptedSource()
    guard = LiveGuard(src, ScriptedEvidence([BETTER]), lambda v, why, slot: None)  # champion is v3 now
    serve(guard, src, "1", [HIGH] * 3)
    assert serve(guard, src, "2", [LOW] * 4, previous="1")[0] == ["trial"] and not guard._pending
    assert guard._restored == set()


def test_another_install_during_a_comparison_stops_it_and_the_new_version_is_judged_on_its_own():
    """v2's comparison waits for evidence; v3 is installed: the comparison is aborted (no verdict on v3's
    track), v3's predecessor is v2, and a v3 clearly worse than v2's latest is compared in turn."""
    src, ev = ScriptedSource(), ScriptedEvidence([None, None, BETTER])
    guard = LiveGuard(src, ev, lambda v, why, slot: "2")
    serve(guard, src, "1", [HIGH] * 3)
    assert serve(guard, src, "2", [MID] * 3, previous="1")[0] == ["trial"]
    actions, _ = serve(guard, src, "3", [LOW] * 4, previous="2")
    assert ev.aborted == [TRACK] and ev.begun == ["2", "3"] and actions == ["trial", "rolled_back"]


def test_a_switchback_trial_stops_when_another_version_is_installed():
    rates = SHIFT | {("2", "new"): 0.02, ("3", "new"): 0.02, ("3", "old"): 0.02}
    dep, hold, rolled = SimulatedServer(rates, seed=2), DraftPin(), []
    guard = server_guard(dep, lambda v, why, slot: rolled.append(v) or "1", hold)
    for i in range(40):
        if i == 4:
            dep.install("/drafts/2", "2")
        if i == 9:
            dep.traffic = "new"
        dep.round()
        if guard.trying and "3" not in dep.installs:
            dep.install("/drafts/3", "3")  # the watcher installs a new champion mid-trial
        guard.check()
    assert "2" not in rolled and hold.version is None  # v2's trial ended without a verdict, the pin released


def test_the_reporter_runs_the_guard_when_the_registry_is_down(monkeypatch):
    import time

    from tidespec.backends import live

    class Guard:
        rounds = 0

        def check(self):
            Guard.rounds += 1
    monkeypatch.setattr(live, "report_live", lambda *a: (_ for _ in ()).throw(OSError("MLflow down")))
    reporter = live.LiveReporter(SimulatedServer(SHIFT, 0), "http://mlflow", "t", every_s=0.01, guard=Guard())
    time.sleep(0.3)
    reporter.close()
    assert Guard.rounds >= 2
