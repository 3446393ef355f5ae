"""Draft health (`engine.health`, `serve.draft_health`) and the live guard on the embedded engine
(`serve.guard.LiveGuard` over `serve.draft_health.EngineSource`): live first-token acceptance per
(version, class) against the replay and the previous version — the z-test's false-alarm rate and
power, decayed counts that show a recovery, the engine feeding it and its counters, the report's
metrics and log line, and one rollback per version, decided on the same recent traffic (a shift
rolls nothing back). The rollback through the registry runs in test_promotion."""
import logging
import random

import pytest

from conftest import random_draft
from tidespec.config import EngineParams
from tidespec.engine.health import MIN_CHAINS, DraftHealth, PairedComparison, clearly_below
from tidespec.engine.speculative import Engine, Request
from tidespec.models.runner import DraftRunner
from tidespec.serve.draft_health import EngineSource, HealthReport
from tidespec.serve.guard import LiveGuard
from tidespec.serve.judge import TeacherForced
from tidespec.serve.metrics import ServeMetrics


def test_clearly_below_needs_significance_size_and_data():
    assert clearly_below(0.2, 300, 0.6)  # z = 0.4 / 0.028 = 14
    assert not clearly_below(0.55, 5000, 0.6)  # significant (z 7.2) but only 8 % below the reference
    assert not clearly_below(0.0, MIN_CHAINS - 1, 0.6)  # too few chains for a verdict
    assert clearly_below(0.1, 200, 0.5, 200) and not clearly_below(0.1, 200, 0.5, 50)  # two proportions
    # the replay's own chains count: 0.44 over 100 chains against a fixed 0.6 is clear (z = 0.16 / 0.049 = 3.3),
    # against 0.6 measured over 100 chains it is not (z = 0.16 / 0.070 = 2.3)
    assert clearly_below(0.44, 100, 0.6) and not clearly_below(0.44, 100, 0.6, 100)


def test_false_alarms_and_power_of_the_replay_check():
    """Healthy drafts (live a₁ drawn at the replayed rate) over 400 chains: the z = 3 test flags at
    most ~0.13 % of them (Binomial, 1000 checks: ≤ 5 allowed, P(more) < 1e-3 under the bound); a draft at
    half its replayed acceptance is flagged every time."""
    rng = random.Random(0)
    healthy = regressed = 0
    for _ in range(1000):
        p0 = rng.uniform(0.2, 0.8)
        ok = sum(rng.random() < p0 for _ in range(400))
        bad = sum(rng.random() < p0 / 2 for _ in range(400))
        healthy += clearly_below(ok / 400, 400, p0)
        regressed += clearly_below(bad / 400, 400, p0)
    assert healthy <= 5 and regressed == 1000


def test_health_by_version_and_class_recovers_with_the_window():
    h = DraftHealth(window=200)
    h.serve("1", {"": (0.5, 400), "code": (0.7, 150)})
    for i in range(300):
        h.observe("1", "code", i % 10 < 7)  # 0.7 on code: healthy
        h.observe("1", "chat", i % 10 < 1)  # 0.1 on chat: below the overall replay 0.5
    assert not h.against_replay("1", "code").below and h.against_replay("1", "chat").below
    assert h.against_replay("1", "chat").reference == 0.5  # no class figure: the overall one
    h.serve("1b", {"": (0.5, 400), "code": (0.2, 150)})  # per-class replay: 0.2 on code, not the overall 0.5
    for i in range(300):
        h.observe("1b", "code", i % 10 < 2)
    assert h.against_replay("1b", "code").reference == 0.2 and not h.against_replay("1b", "code").below
    h.serve("1")  # back to "1" (as after a rollback): it keeps no new predecessor
    assert h.previous("1") is None and h.previous("1b") == "1"
    h.serve("2")
    for i in range(300):
        h.observe("2", "code", i % 10 < 2)
    v = h.against_previous("2", "code")
    assert v.below and v.reference == pytest.approx(0.7, abs=0.01) and h.previous("2") == "1"
    h.serve("1")  # restored: never judged against the version it replaced on the way back
    assert h.previous("1") is None and not h.against_previous("1", "code").below
    for _ in range(1500):  # the draft recovers: the decayed window forgets the bad chains
        h.observe("2", "code", True)
    assert not h.against_previous("2", "code").below


def test_engine_feeds_health_and_the_guard_reports_and_rolls_back_once(tiny_target, caplog):
    from collections import Counter

    off = DraftRunner(
        random_draft(tiny_target, 64, counts=Counter(range(250, 314)))
    )  # drafts ids the target rarely emits
    eng = Engine(tiny_target, off, EngineParams(num_draft_tokens=3, max_seq_len=256, max_batch=8), draft_version="7")
    eng.set_draft(off, "7", replayed={"": (0.9, 300)})  # its evaluation claimed 0.9 over 300 chains: far below
    reqs = [Request([5 + i, 6, 7], 60, workload="chat") for i in range(8)]
    gens = eng.generate_batch(reqs)
    chains = sum(g.by_proposer["eagle3"].num_drafts for g in gens)
    first = sum(g.by_proposer["eagle3"].num_accepted_tokens_per_pos[0] for g in gens)
    live, n = eng.health.live("7", "chat")
    w = eng.health.window  # decayed sums: n = Σ_{i<chains} (1 − 1/w)^i
    assert n == pytest.approx(w * (1 - (1 - 1 / w) ** chains)) and live == pytest.approx(first / chains, abs=0.02)
    assert n >= MIN_CHAINS and live < 0.5
    c = eng.health.counters("7", "chat")  # the live guard's counters: every chain, as vLLM counts drafts
    drafted = sum(g.by_proposer["eagle3"].num_draft_tokens for g in gens)
    assert (c.num_drafts, c.accepted_per_pos[0], c.num_draft_tokens) == (chains, first, drafted)
    assert c.num_accepted_tokens == sum(c.accepted_per_pos) and len(c.accepted_per_pos) == 3
    metrics, calls = ServeMetrics(3), []

    def rollback(v, why, slot):
        calls.append((v, why))
        if len(calls) == 1:
            raise RuntimeError("registry down")  # the first attempt fails: retried at the next check
        return "7"  # the restored version

    worse_here = PairedComparison(0.5, 0.1, 20)  # the same-traffic scoring (test below): v7 clearly better
    guard = LiveGuard(EngineSource(eng), TeacherForced(lambda v, prev, w: worse_here), rollback)
    report = HealthReport(eng, metrics, every_s=0, guard=guard)
    with caplog.at_level(logging.WARNING, logger="tidespec.serve.draft_health"):
        below = report.check()
        report.check()
    assert [(v.workload, v.reference) for v in below] == [("chat", 0.9)]
    assert sum("clearly below its replayed acceptance 0.900" in r.message for r in caplog.records) == 1  # once
    sample = metrics.registry.get_sample_value
    assert sample("tidespec:draft_regressed", {"against": "replay", "version": "7", "workload": "chat"}) == 1.0
    assert calls == []  # below its replay only: no predecessor, no rollback

    def rounds(version: str, accepted, n: int) -> None:
        for _ in range(n):
            for i in range(120):
                eng.health.observe(version, "chat", accepted(i), 3)
            report.check()

    rounds("7", lambda i: i % 2, 3)  # v7's latest windows: τ 1.5
    eng.set_draft(DraftRunner(random_draft(tiny_target, 64, seed=1)), "8")  # a new version, same traffic
    rounds("8", lambda i: 0, 6)  # never accepted: reference, trial, verdict, a failed rollback, then done
    assert [v for v, _ in calls] == ["8", "8"] and "clearly below v7's latest 1.500" in calls[0][1]
    assert sample("tidespec:draft_rollbacks_total") == 1.0
    eng.set_draft(None)
    assert report.check() == [] and sample("tidespec:draft_regressed", {"against": "previous", "version": "8",
                                                                        "workload": "chat"}) is None  # no stale gauge


def test_guard_labels_stay_bounded_and_server_classes_keep_theirs(tiny_target):
    """Clients name classes: 40 of them take the 32 free label values (the rest count as "other"),
    and the server's own classes keep their labels whatever came first; health keeps 64 apart."""
    metrics = ServeMetrics(3)
    labels = [metrics.label(f"junk{i}") for i in range(40)]
    assert labels[:32] == [f"junk{i}" for i in range(32)] and set(labels[32:]) == {"other"}
    assert metrics.label("code") == "code" and metrics.label("structured") == "structured"
    h = DraftHealth()
    h.serve("1")
    for i in range(100):
        h.observe("1", f"c{i}", True)
    assert len(h.classes("1")) == 65 and "other" in h.classes("1")


def test_replayed_figures_travel_from_evaluate_to_version_json(tmp_path):
    """evaluate's metrics → tag first_token_acceptance ({class: [a₁, chains]}) → version.json → the engine."""
    import json

    from tidespec.adapters.registry import FIRST_TOKEN_TAG, replayed
    from tidespec.steps.register import first_token_acceptance
    from tidespec.workspace import read_version, write_version
    m = {"accepted_per_pos/0": 0.4, "num_drafts": 230.0, "accepted_per_pos/1": 0.2,
         "first_token_acceptance/code": 0.5, "num_drafts/code": 120, "first_token_acceptance/chat": 0.3}
    rep = first_token_acceptance(m)
    assert rep == {"": [0.4, 230.0], "code": [0.5, 120.0], "chat": [0.3, 0.0]}
    assert replayed({FIRST_TOKEN_TAG: json.dumps(rep)}) == rep and replayed({FIRST_TOKEN_TAG: "{bad"}) == {}
    write_version(tmp_path, "3", "run", None, rep)
    assert read_version(tmp_path)["replayed"] == rep
    (tmp_path / "version.json").write_text(json.dumps({"version": "3", "replayed": {"": [1.5, 10]}}))
    with pytest.raises(ValueError, match="replayed"):
        read_version(tmp_path)


def test_a_shift_of_traffic_rolls_nothing_back_and_a_worse_draft_is_rolled_back_on_the_same_traffic(tmp_path):
    """The embedded guard's rollback is decided on the same recent traffic (`serve.judge`):
    v1 (a draft trained on the target's outputs for 48 prompts) serves those prompts;
    v2 (the same weights, a retrained twin) then serves prompts of ids [200, 320), where any draft is
    accepted less: its live a₁ is clearly below v1's earlier one (the hint), but scored on the same
    recent records both are equal, so nothing is rolled back. v3 (a random draft) on the same traffic
    is clearly worse than v2 there and is rolled back, with the paired figures in the reason."""
    import torch

    from conftest import make_varied_target, train_on_greedy
    from tidespec.capture.recent import RecentRecords
    from tidespec.models.eagle3 import load_checkpoint, save_checkpoint
    from tidespec.models.target import load_target
    from tidespec.serve.judge import PairedJudge

    target = load_target(make_varied_target(tmp_path / "t"))[0]
    trained_prompts, _ = train_on_greedy(target, tmp_path / "v1")
    save_checkpoint(random_draft(target, 320, seed=3), tmp_path / "v3")
    dirs = {"1": tmp_path / "v1", "2": tmp_path / "v1", "3": tmp_path / "v3"}
    recent = RecentRecords(32)
    eng = Engine(target, None, EngineParams(num_draft_tokens=3, max_seq_len=128, max_batch=16), capture=recent)
    calls, judged, judge = [], [], PairedJudge(eng, recent.records, dirs.__getitem__)
    guard = LiveGuard(EngineSource(eng), TeacherForced(lambda *a: judged.append(judge(*a)) or judged[-1]),
                      lambda v, why, slot: calls.append((v, why)))
    g = torch.Generator().manual_seed(1)

    def serve(version: str, prompts: list[list[int]], chunks: int = 3) -> list[str]:
        """The version serves the prompts in `chunks` rounds of traffic, the guard checking after each."""
        eng.set_draft(DraftRunner(load_checkpoint(dirs[version], target.embed, target.target_id)), version)
        actions = guard.check()
        for j in range(chunks):
            eng.generate_batch([Request(p, 40, workload="code") for p in prompts[j::chunks]])
            actions += guard.check()
        return actions

    shifted = [torch.randint(200, 320, (6,), generator=g).tolist() for _ in range(48)]
    assert serve("1", trained_prompts) == []
    actions = serve("2", shifted, 4)
    a1, a2 = eng.health.live("1", "code")[0], eng.health.live("2", "code")[0]
    assert eng.health.against_previous("2", "code").below and a2 < 0.75 * a1, (a1, a2)  # the hint's premise
    assert actions == ["trial", "kept"] and calls == []  # the hint fired; on the same records: equal
    assert judged[0].diff == 0.0 and judged[0].n >= 8  # same weights, same records
    serve("3", shifted, 4)
    cmp = judged[-1]
    assert cmp.previous_better and cmp.n >= 30 and len(calls) == 1 and calls[0][0] == "3"
    assert "teacher-forced on the same recent traffic: v2 − v3 = +" in calls[0][1]
