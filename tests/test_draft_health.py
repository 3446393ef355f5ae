"""Draft health (`engine.health`, `serve.guard`): live first-token acceptance per (version, class)
against the replay and the previous version — the z-test's false-alarm rate and power, decayed
counts that show a recovery, the engine feeding it, and the guard's metrics, log line and one
rollback per version. The rollback through the registry runs in test_promotion."""
import logging
import random

import pytest
from conftest import random_draft

from tidespec.engine.health import MIN_CHAINS, DraftHealth, clearly_below
from tidespec.engine.speculative import Engine, Request
from tidespec.models.eagle3 import DraftRunner
from tidespec.serve.guard import HealthGuard
from tidespec.serve.metrics import ServeMetrics


def test_clearly_below_needs_significance_size_and_data():
    assert clearly_below(0.2, 300, 0.6)  # z = 0.4 / 0.028 = 14
    assert not clearly_below(0.55, 5000, 0.6)  # significant (z 7.2) but only 8 % below the reference
    assert not clearly_below(0.0, MIN_CHAINS - 1, 0.6)  # too few chains for a verdict
    assert clearly_below(0.1, 200, 0.5, 200) and not clearly_below(0.1, 200, 0.5, 50)  # two proportions


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
    h.serve("1", {"": 0.5, "code": 0.7})
    for i in range(300):
        h.observe("1", "code", i % 10 < 7)  # 0.7 on code: healthy
        h.observe("1", "chat", i % 10 < 1)  # 0.1 on chat: below the overall replay 0.5
    assert not h.against_replay("1", "code").below and h.against_replay("1", "chat").below
    assert h.against_replay("1", "chat").reference == 0.5  # no class figure: the overall one
    h.serve("2")
    for i in range(300):
        h.observe("2", "code", i % 10 < 2)
    v = h.against_previous("2", "code")
    assert v.below and v.reference == pytest.approx(0.7, abs=0.01) and h.previous("2") == "1"
    for _ in range(1500):  # the draft recovers: the decayed window forgets the bad chains
        h.observe("2", "code", True)
    assert not h.against_previous("2", "code").below


def test_engine_feeds_health_and_the_guard_reports_and_rolls_back_once(tiny_target, caplog):
    from collections import Counter
    off = DraftRunner(random_draft(tiny_target, 64, counts=Counter(range(250, 314))))  # drafts ids the target rarely emits
    eng = Engine(tiny_target, off, 3, 256, draft_version="7", max_batch=8)
    eng.set_draft(off, "7", replayed={"": 0.9})  # its evaluation claimed 0.9: this draft is far below
    reqs = [Request([5 + i, 6, 7], 60, workload="chat") for i in range(8)]
    gens = eng.generate_batch(reqs)
    chains = sum(g.stats_by_proposer["eagle3"].num_drafts for g in gens)
    first = sum(g.stats_by_proposer["eagle3"].num_accepted_tokens_per_pos[0] for g in gens)
    live, n = eng.health.live("7", "chat")
    w = eng.health.window  # decayed sums: n = Σ_{i<chains} (1 − 1/w)^i
    assert n == pytest.approx(w * (1 - (1 - 1 / w) ** chains)) and live == pytest.approx(first / chains, abs=0.02)
    assert n >= MIN_CHAINS and live < 0.5
    metrics, calls = ServeMetrics(3), []
    guard = HealthGuard(eng, metrics, every_s=0, rollback=lambda v, why: calls.append((v, why)))
    with caplog.at_level(logging.WARNING, logger="tidespec.serve.guard"):
        below = guard.check()
        guard.check()
    assert [(v.workload, v.reference) for v in below] == [("chat", 0.9)]
    assert sum("clearly below its replayed acceptance 0.900" in r.message for r in caplog.records) == 1  # once
    from prometheus_client import generate_latest
    text = generate_latest(metrics.registry).decode()
    assert 'tidespec:draft_regressed{against="replay",version="7",workload="chat"} 1.0' in text
    assert calls == []  # against its replay only: no predecessor, no rollback
    eng.set_draft(DraftRunner(random_draft(tiny_target, 64, seed=1)), "8")  # a new version, same traffic
    eng.health._live[("8", "chat")] = [0.0, 500.0]  # the new version: never accepted (as counted)
    eng.health._live[("7", "chat")] = [250.0, 500.0]  # the old one: half its chains
    assert guard.check() and guard.check() is not None
    assert [v for v, _ in calls] == ["8"] and "clearly below v7's 0.500" in calls[0][1]  # once per version
    assert metrics.registry.get_sample_value("tidespec:draft_rollbacks_total") == 1.0
