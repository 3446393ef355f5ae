"""The batch-aware goodput policy: a step's cost by the batch's total verify rows, per-request
choices of proposer and length for the whole step, online re-fit that outliers cannot turn into
speed-up predictions, and the engine wiring (lossless, measured steps fed back)."""
import math
import random

import pytest

from conftest import ladder, random_draft
from tidespec.bench import policy_report
from tidespec.config import EngineParams
from tidespec.engine.calibration import Calibration, calibrate
from tidespec.engine.policy import GoodputPolicy, StepCost, goodput, plan, predicted_step
from tidespec.engine.policy.margin import REALIZED_PRIOR
from tidespec.engine.speculative import Engine, Request
from tidespec.engine.suffix_tree import SuffixCache
from tidespec.models.runner import DraftRunner

# A CPU-like machine: alone, a forward of 1..5 rows costs about the same (weight-bound); at batch 8
# each extra row per request costs 180 ms / 8 requests (compute-bound), so speculation that pays
# alone loses under load.
GRID = ((100.0, 101.0, 102.0, 103.0, 104.0),
        (200.0, 380.0, 560.0, 740.0, 920.0))


def _cal(draft_ms=(2.0, 4.0)):
    return Calibration(GRID[0], draft_ms[0], "test", 128, (1, 8), (1, 2, 3, 4, 5), GRID, draft_ms)


def test_calibration_interpolates_by_batch_and_rows():
    cal = _cal()
    assert cal.target_cost(1, 3) == pytest.approx(102)
    assert cal.target_cost(8, 16) == pytest.approx(380)  # 8 requests × 2 rows
    assert cal.target_cost(8, 12) == pytest.approx(290)  # 1.5 rows each: between the grid points
    assert cal.target_cost(4, 4) == pytest.approx(100 + 100 * 3 / 7)  # batch 4, 1 row: between b = 1 and 8
    assert cal.target_cost(8, 48) == pytest.approx(920 + 180)  # 6 rows each: extended linearly
    assert cal.draft_cost(0) == 0 and cal.draft_cost(8) == 4.0
    with pytest.raises(ValueError, match="grid"):
        Calibration(GRID[0], 2.0, "x", 128, (1, 8), (1, 2, 3), GRID, (2.0, 4.0))


def test_plan_speculates_alone_and_not_under_load():
    cost = StepCost(_cal())
    code = ladder(eagle=GoodputPolicy(_cal(), prior=0.6).estimator("eagle3").gains("code"))
    alone = plan([code], cost)
    assert alone == [("eagle3", 4)]  # τ(4) = 2.31 for 112 ms vs 1 token per 100 ms
    assert plan([code] * 8, cost) == [("", 0)] * 8  # 8 × 1.6 tokens for 380 ms < 8 tokens for 200 ms
    # the same draft alone at k = 4 in the batch would predict (8 × 2.31) / 936 ms: 0.49× plain — the
    # per-request policy (a mutant ignoring the batch) is what made fixed k = 4 lose 0.79× at 8 clients
    per_request = [alone[0]] * 8
    assert goodput([code] * 8, per_request, cost) < 0.5 * goodput([code] * 8, [("", 0)] * 8, cost)
    sure = [ladder(eagle=(0.99, 1.97, 2.94, 3.9))] * 8  # a near-certain draft: ~1 token per 22.5 ms row vs 25
    ch = plan(sure, cost, margin=0.0)  # ms per plain token: it pays at batch 8, by less than the 5 % margin
    assert sum(n for _, n in ch) >= 8 and goodput(sure, ch, cost) > 1.04 * goodput(sure, [("", 0)] * 8, cost)
    assert plan(sure, cost) == [("", 0)] * 8


def test_plan_mixes_proposers_per_request():
    cost = StepCost(_cal())
    ladders = [ladder(eagle=(0.5, 0.75), suffix=(1.0, 2.0, 3.0, 3.9, 4.8, 5.6)),  # a long sure suffix match
               ladder(eagle=(0.7, 1.2)),
               ladder(fixed=("eagle3", 2), fixed_gain=0.3)]  # a seeded request keeps its k
    ch = plan(ladders, cost)
    assert ch[0] == ("suffix", 6) and ch[1][0] == "eagle3" and ch[2] == ("eagle3", 2)
    # margin: a gain within 5 % of plain decoding keeps speculation off
    weak = [ladder(eagle=(0.02,))]
    assert plan(weak, cost) == [("", 0)] and plan(weak, cost, margin=0.0) == [("", 0)]  # 1.02/102 < 1/100


def test_step_cost_refit_cannot_predict_speedups_from_spikes():
    """Plain steps at batch 8 hit 8× spikes half the time, speculative steps are measured quiet:
    the predicted speed-up of any choice stays ≤ its calibrated one (load scales every cell alike)."""
    cal = _cal()
    cost = StepCost(cal)
    rng = random.Random(0)
    for _ in range(300):
        cost.observe(8, 8, [], 200 * (8.0 if rng.random() < 0.5 else 1.0))
        cost.observe(8, 40, [8, 8, 8, 8], 0.6 * cost.calibrated(8, 40, [8, 8, 8, 8]))
    quiet = StepCost(cal)
    lad = [ladder(eagle=(0.3, 0.45, 0.5, 0.52))] * 8
    for k in range(1, 5):
        ch = [("eagle3", k)] * 8
        speedup = goodput(lad, ch, cost) / goodput(lad, [("", 0)] * 8, cost)
        assert speedup <= goodput(lad, ch, quiet) / goodput(lad, [("", 0)] * 8, quiet) + 1e-9
    assert plan(lad, cost) == [("", 0)] * 8
    assert cost.factor(8, 1) > 1.5  # the load was learned (clipped EMA), not replaced by one spike
    cost.observe(8, 8, [], float("nan"))
    cost.observe(8, 8, [], -1.0)
    assert cost.factor(8, 1) == cost.factor(8, 1) < 10


def test_policy_reports_k_by_batch_and_learns_suffix_correction():
    sure = GoodputPolicy(_cal(), prior=0.6, alpha=1.0)  # alpha 1: the last observation is the estimate
    sure.estimator("eagle3").observe_chain("code", 4, 1)  # a = [1, 0, .6, .6]: one sure token per step
    assert policy_report.report(sure)["code"]["k_by_batch"] == {
        1: 1,
        8: 0,
    }  # at 8: 16 tokens / 384 ms is within the margin of 8 / 200
    pol = GoodputPolicy(_cal(), prior=0.6, alpha=0.5)
    assert pol.estimator("suffix").gains("chat", (0.9, 0.8)) == pytest.approx((0.9, 1.7))
    for _ in range(20):  # suffix scores said 1.7 expected, 0.85 were accepted
        pol.estimator("suffix").observe_proposal("chat", 1.7, 0 if _ % 2 else 2)
    # the EMA (alpha 0.5) of accepted after ..., 2, 0 is 2/3; the ratio 2/3 / 1.7 = 0.39 weighs 1/alpha = 2
    # proposals against the prior's one at 1.0: (2 · 0.39 + 1) / 3
    assert pol.estimator("suffix").correction("chat") == pytest.approx((2 * (2 / 3) / 1.7 + 1) / 3, abs=1e-3)
    assert pol.estimator("suffix").gains("chat", (0.9, 0.8))[1] < 1.1
    pol.estimator("suffix").observe_proposal(
        "code", 2.0, 0
    )  # one wrong proposal halves it at once: (1 · 0 + 1) / (1 + 1)
    assert pol.estimator("suffix").correction("code") == 0.5 and pol.estimator("suffix").gains("code", (0.9,)) == (
        0.45,
    )
    for _ in range(30):  # all wrong: it falls to 1 / (1/alpha + 1) and stays there, never 0
        pol.estimator("suffix").observe_proposal("code", 2.0, 0)
    assert pol.estimator("suffix").correction("code") == pytest.approx(1 / 3)


def test_real_calibration_grid_is_monotone(tiny_target):
    runner = DraftRunner(random_draft(tiny_target, 64))
    cal = calibrate(tiny_target, runner, 2, context=16, reps=1, max_batch=4, max_rows=6)
    assert cal.batch_sizes == (1, 2, 4) and cal.rows == (1, 2, 3, 6)
    for row in cal.grid_ms:
        assert list(row) == sorted(row)
    for j in range(len(cal.rows)):
        col = [row[j] for row in cal.grid_ms]
        assert col == sorted(col)
    assert list(cal.draft_batch_ms) == sorted(cal.draft_batch_ms) and cal.draft_batch_ms[0] > 0


class _Spy(GoodputPolicy):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.steps = []

        self.realized_steps = []

    def observe_step(self, b, rows, drafts, ms):
        self.steps.append((b, rows, tuple(drafts)))
        super().observe_step(b, rows, drafts, ms)

    def observe_realized(self, workloads, speculated, predicted, tokens, ms):
        self.realized_steps.append((len(workloads), speculated, predicted, tokens, ms))
        super().observe_realized(workloads, speculated, predicted, tokens, ms)


def test_engine_with_goodput_policy_is_lossless_and_feeds_back_step_costs(tiny_target):
    pol = _Spy(Calibration((100.0, 101.0, 102.0, 103.0), 1.0, "test", 128), prior=0.9, probe_every=4)
    eng = Engine(
        tiny_target,
        DraftRunner(random_draft(tiny_target, 64)),
        EngineParams(num_draft_tokens=3, max_seq_len=256, max_batch=4, draft_early_stop=False),
        policy=pol,
        suffix=SuffixCache(max_depth=8),
    )
    ref = Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256))
    ps = [[5, 6, 7], [11, 12, 13, 11, 12, 13, 11, 12], [42], [9, 30, 31, 9, 30]]
    want = [ref.generate(p, 24).tokens for p in ps]
    gens = eng.generate_batch([Request(p, 24, workload="code") for p in ps])
    assert [g.tokens for g in gens] == want
    via = {k for g in gens for k in g.by_proposer}
    assert "suffix" in via  # the tiny target repeats itself: suffix proposals win steps
    assert pol.steps and all(rows >= b for b, rows, _ in pol.steps)
    for b, _rows, drafts in pol.steps:  # draft positions never exceed the batch, one entry per chain position
        assert all(0 < n <= b for n in drafts) and list(drafts) == sorted(drafts, reverse=True)
    assert max(b for b, _, _ in pol.steps) == 4
    assert sum(rows - b for b, rows, _ in pol.steps) == sum(g.stats.num_draft_tokens for g in gens)
    # every decode step's plan is weighed against what it realized: its tokens (one per request plus
    # the accepted drafts; all were admitted in the first step, so every later step is decode-only)
    real = pol.realized_steps  # probe steps are not the plan's choice: not counted
    assert 0 < len(real) <= len(pol.steps)
    assert any(spec for _, spec, *_ in real)
    assert all(tok == b for b, spec, _, tok, _ in real if not spec)
    accepted = sum(tok - b for b, _, _, tok, _ in real)  # not the drafts verified: the random draft misses most
    assert sum(rows - b for b, rows, _ in pol.steps) > accepted >= sum(g.stats.num_accepted_tokens for g in gens) > 0
    assert all(p_tok >= b and p_ms > 0 and ms > 0 for b, _, (p_tok, p_ms), _, ms in real)
    assert list(pol.margins.report()) == ["code"] and set(pol.margins.report()["code"]) <= {1, 2, 4}


def test_engine_under_load_switches_speculation_off(tiny_target):
    """With a machine where rows are dear at batch 8 (GRID), a batch of 8 drafts only on probes."""
    cal = Calibration(GRID[0][:4], 2.0, "test", 128, (1, 8), (1, 2, 3, 4), tuple(r[:4] for r in GRID), (2.0, 4.0))
    pol = GoodputPolicy(cal, prior=0.6, probe_every=8)
    eng = Engine(
        tiny_target,
        DraftRunner(random_draft(tiny_target, 64)),
        EngineParams(num_draft_tokens=3, max_seq_len=256, max_batch=8, draft_early_stop=False),
        policy=pol,
    )
    gens = eng.generate_batch([Request([5 + i, 6, 7], 24, workload="chat") for i in range(8)])
    drafts = sum(g.stats.num_drafts for g in gens)
    assert 0 < drafts <= 8 * 24 // 8 + 8  # one probe per class every 8th request-step
    # a new class: the prior says speculate alone, not at 8
    assert policy_report.k_by_batch(pol, "fresh") == {1: 3, 8: 0}


def test_early_stop_threshold_and_learned_confidence():
    pol = GoodputPolicy(_cal(), prior=0.6, alpha=0.2)
    assert (
        pol.estimator("eagle3").accept_given_confidence("code", 0.37) == 0.37
    )  # unobserved bin: the draft's own confidence
    for _ in range(10):  # confident drafts (0.9) are rejected at position 0: the bin learns it
        pol.estimator("eagle3").observe_confidence("code", [0.91, 0.2], 0)
    assert pol.estimator("eagle3").accept_given_confidence("code", 0.95) < 0.1
    assert pol.estimator("eagle3").accept_given_confidence("code", 0.25) == 0.25  # never reached: still unobserved
    pol.estimator("eagle3").observe_confidence("code", [0.25, 0.25, 0.25], 3)
    assert pol.estimator("eagle3").accept_given_confidence("code", 0.21) == 1.0
    code = ladder(eagle=(0.6, 0.96, 1.18, 1.31))
    alone = pol.stop_below([code], [("eagle3", 4)])
    # alone one more row costs ~1 ms and one more request in a draft step ~0.3 ms, against ~2.3 tokens
    # per 112 ms: stop below ~0.027
    assert 0.02 < alone < 0.035
    loaded = pol.stop_below([code] * 8, [("eagle3", 1)] * 8)
    assert loaded > 4 * alone  # at batch 8 a row costs 22.5 ms: a token must be far likelier to pay


def test_engine_early_stop_shortens_chains_and_stays_lossless(tiny_target, monkeypatch):
    """A random draft is rarely right: with the learned confidence, chains stop after one token."""
    monkeypatch.setattr(
        "tidespec.engine.policy.probes.PROBE_BACKOFF", 1
    )  # probe_every=1 below: every step, no back-off
    cal = Calibration((100.0, 101.0, 102.0, 103.0, 104.0), 1.0, "test", 128)
    ps = [[5, 6, 7], [11, 12, 13, 11, 12], [42], [9, 30, 31, 9, 30]]
    ref = [
        Engine(tiny_target, None, EngineParams(num_draft_tokens=4, max_seq_len=256)).generate(p, 24).tokens for p in ps
    ]
    runs = {}
    for stop in (False, True):
        pol = GoodputPolicy(cal, prior=1.0, alpha=0.05, probe_every=1)  # prior 1 + probe every step: always drafts
        eng = Engine(
            tiny_target,
            DraftRunner(random_draft(tiny_target, 64)),
            EngineParams(num_draft_tokens=4, max_seq_len=256, max_batch=4, draft_early_stop=stop),
            policy=pol,
        )
        for _ in range(2):  # the first round teaches the confidence bins
            gens = eng.generate_batch([Request(p, 24, workload="code") for p in ps])
            assert [g.tokens for g in gens] == ref
        runs[stop] = sum(g.stats.num_draft_tokens for g in gens) / sum(g.stats.num_drafts for g in gens)
    assert runs[True] < runs[False]  # tokens per chain: early stop cut them


def test_early_stop_default_written_out_is_not_refused_without_the_policy():
    """draft_early_stop: true is the default and the shipped params.yaml writes it out, so switching
    the policy off (adaptive: false) in that file must not be refused for it; off it is a no-op too."""
    from tidespec.config import EngineParams
    assert EngineParams(adaptive=False, draft_early_stop=True).changed("draft_early_stop", "adaptive") == ["adaptive"]
    assert not EngineParams(adaptive=False, draft_early_stop=False).adaptive


def test_review_fixes_draft_costs_probes_backlog_grid(tiny_target):
    """A draft swapped into an engine whose calibration timed no draft is timed before it serves;
    probes rotate over a class's idle requests; backlogs hold copies, not views of a step's tensor;
    a grid that is not increasing is refused."""
    cal = Calibration((100.0, 101.0, 102.0, 103.0), 0.0, "test", 128, (1, 4), (1, 2, 3, 4),
                      ((100.0, 101.0, 102.0, 103.0), (150.0, 200.0, 250.0, 300.0)), (0.0, 0.0))
    pol = GoodputPolicy(cal, prior=0.0, probe_every=4)
    eng = Engine(
        tiny_target,
        None,
        EngineParams(num_draft_tokens=3, max_seq_len=256, max_batch=4, draft_early_stop=False),
        policy=pol,
        suffix=SuffixCache(max_depth=8),
    )
    runner = DraftRunner(random_draft(tiny_target, 64))
    eng.set_draft(runner, "v1")
    assert pol.cal.draft_shape == (runner.config.hidden_size, runner.config.intermediate_size, 64)
    assert all(ms > 0 for ms in pol.cal.draft_batch_ms) and pol.cost.cal is pol.cal
    assert not pol.ensure_draft_costs(tiny_target, runner)  # same shape: not timed again
    probed = []
    for step in range(1, 301):
        ch = pol.plan_step(["chat"] * 4, [ladder(eagle=(0.0, 0.0, 0.0))] * 4)
        probed += [(step, i) for i, c in enumerate(ch) if c[1]]
    # a class left off: probes after 4, 8, 16, 32, 64 idle steps, then every 64 (PROBE_BACKOFF × 4),
    # rotating over its requests
    assert [s for s, _ in probed] == [4, 12, 28, 60, 124, 188, 252]
    assert sorted({i for _, i in probed}) == [0, 1, 2, 3]
    two = GoodputPolicy(cal, prior=0.0, probe_every=1)  # two classes idle together: each rotates over its own requests
    seen = set()
    for _ in range(200):
        ch = two.plan_step(["chat", "chat", "code", "code"], [ladder(eagle=(0.0, 0.0, 0.0))] * 4)
        seen |= {i for i, c in enumerate(ch) if c[1]}
    assert seen == {0, 1, 2, 3}
    fut = eng.submit(Request([5, 6, 7], 12, workload="chat"))
    eng.step()
    eng.step()
    s = eng._running[0]
    assert s.backlog and all(a.untyped_storage().nbytes() == a.nbytes for a, _ in s.backlog)
    while not fut.done():
        eng.step()
    with pytest.raises(ValueError, match="strictly increasing"):
        Calibration((100.0, 101.0), 0.0, "x", 128, (1, 1), (1, 2), ((100.0, 101.0), (100.0, 101.0)), (0.0, 0.0))
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        eng.set_suffix_corpus([[5, 6], [tiny_target.cfg.vocab_size]])


def test_hysteresis_holds_speculation_at_a_batch_size_boundary():
    """A load that sits on a boundary (1 request, then 2, then 1...): alone k = 1 is predicted to
    gain 9.8 %, with two requests 4.0 % — between margin_off (2 %) and margin (5 %). Without the
    band speculation flaps on/off every step (each switch back on pays a catch-up); with it, it stays
    on; and from off, a 4 % gain does not switch it on."""
    cal = Calibration((100.0, 101.0), 1.0, "test", 128, (1, 2), (1, 2), ((100.0, 101.0), (150.0, 160.0)), (1.0, 1.5))
    lad = ladder(eagle=(0.12,))
    cost = StepCost(cal)
    assert goodput([lad], [("eagle3", 1)], cost) / goodput([lad], [("", 0)], cost) == pytest.approx(1.12 * 100 / 102)
    both = goodput([lad] * 2, [("eagle3", 1)] * 2, cost) / goodput([lad] * 2, [("", 0)] * 2, cost)
    assert both == pytest.approx(1.12 * 150 / 161.5)  # 1.040

    def on_per_step(margin_off):
        pol = GoodputPolicy(cal, prior=0.6, probe_every=1000, margin=0.05, margin_off=margin_off)
        return [any(c[1] for c in pol.plan_step(["code"] * b, [lad] * b)) for b in (1, 2) * 4]

    assert on_per_step(0.05) == [True, False] * 4  # no band: flaps with the batch size
    assert on_per_step(0.02) == [True] * 8
    pol = GoodputPolicy(cal, prior=0.6, probe_every=1000, margin=0.05, margin_off=0.02)
    assert pol.plan_step(["code"], [lad])[0][1] and pol.plan_step(["chat"] * 2, [lad] * 2) == [("", 0)] * 2
    # ↑ the band is per class: code drafting does not let a chat batch in at 4 %
    assert pol.plan_step(["code"], [lad])[0][1]
    pol.plan_step(["code"] * 2, [ladder(suffix=(0.99, 1.9))] * 2)  # a step of suffix proposals only: not the draft
    assert pol.plan_step(["code"] * 2, [lad] * 2) == [("", 0)] * 2
    pol.plan_step(["code"], [lad])
    pol.reset()  # a hot-swap: the band is forgotten with the acceptance
    assert pol.plan_step(["code"] * 2, [lad] * 2) == [("", 0)] * 2
    fresh = GoodputPolicy(cal, prior=0.6, probe_every=1000, margin=0.05, margin_off=0.02)
    assert fresh.plan_step(["code"] * 2, [lad] * 2) == [("", 0)] * 2  # from off: 4 % is not enough
    with pytest.raises(ValueError, match="margin_off"):
        GoodputPolicy(cal, margin=0.05, margin_off=0.06)


def test_probe_back_off_restarts_when_the_class_speculates():
    cal = _cal()
    pol = GoodputPolicy(cal, prior=0.6, probe_every=2)
    dead, good = [ladder(eagle=(0.0, 0.0))] * 8, [ladder(eagle=(0.99, 1.98))]
    steps = [s for s in range(1, 15) if any(c[1] for c in pol.plan_step(["chat"] * 8, dead))]
    assert steps == [2, 6, 14]  # gaps 2, 4, 8
    assert pol.plan_step(["chat"], good) != [("", 0)]  # the class speculates (alone): back-off forgotten
    steps = [s for s in range(1, 7) if any(c[1] for c in pol.plan_step(["chat"] * 8, dead))]
    assert steps == [2, 6]


def test_search_bound_never_skips_a_step_speculation_would_win():
    """`plan` skips its search when no option could beat plain decoding by the margin (a bound on
    gains and rows). Brute force over every combination of small batches: whenever some combination
    beats the margin, the plan speculates."""
    import itertools

    from tidespec.engine.policy.search import _options
    rng = random.Random(3)
    cost = StepCost(_cal())
    for case in range(300):
        b = rng.randint(1, 3)
        lads = []
        for _ in range(b):
            acc = [rng.random() ** rng.choice((1, 4)) for _ in range(3)]
            eagle = tuple(sum(math.prod(acc[:j + 1]) for j in range(i + 1)) for i in range(3))
            sfx = tuple(sorted(rng.random() * 3 for _ in range(rng.randint(0, 4))))
            gr = tuple(sorted(rng.random() * 3 for _ in range(rng.randint(0, 3))))
            lads.append(ladder(eagle=eagle if rng.random() < 0.8 else (), suffix=sfx, grammar=gr))
        g0 = goodput(lads, [("", 0)] * b, cost)
        best = max(goodput(lads, list(c), cost) for c in itertools.product(*[_options(x) for x in lads]))
        ch = plan(lads, cost, margin=0.05)
        if best >= 1.05 * g0 * (1 + 1e-9):
            assert ch != [("", 0)] * b, case
    # and it is tight enough to skip the search where a batch cannot pay: 8 requests whose best is 0.6
    # tokens per 22.5-ms row against 25 ms per plain token (the old bound, Σ gains for one row, ran it)
    from tidespec.engine.policy.search import _bound, _Step
    lads = [ladder(eagle=(0.6, 0.96, 1.18, 1.31))] * 8
    st = _Step(lads, cost, [("", 0)] * 8)
    assert _bound(lads, list(range(8)), {i: 1.31 for i in range(8)}, st, cost) < 1.05 * st.value()
    assert (8 + 8 * 1.31) / cost.predict(8, 9) > 1.05 * st.value()


def test_suffix_proposals_do_not_starve_the_draft_probes():
    """A class whose requests often take suffix proposals still probes its EAGLE3 draft: only an EAGLE3
    choice refreshes that estimate (and resets the back-off)."""
    cost_cal = _cal()
    pol = GoodputPolicy(cost_cal, prior=0.6, probe_every=2)
    dead_eagle = ladder(eagle=(0.0, 0.0))
    sure_suffix = ladder(eagle=(0.0, 0.0), suffix=(0.99, 1.98, 2.97))
    probed = []
    for step in range(1, 9):
        ch = pol.plan_step(["code"] * 2, [sure_suffix, dead_eagle])
        assert ch[0][0] == "suffix"  # the copy pays, every step
        probed += [step for c in ch if c[0] == "eagle3"]
    assert probed == [2, 6]  # request 1 is probed with back-off (gaps 2, 4) although the class speculates


def test_suffix_proposals_left_unchosen_stop_being_computed_and_are_probed():
    """Per class and batch size: after probe_every steps whose suffix proposals the plan left
    unchosen they are computed only on probe steps (gaps doubling), one chosen turns them back on;
    another batch size and another class are not affected; a hot-swap forgets it."""
    pol = GoodputPolicy(_cal(), prior=0.6, probe_every=2)
    due = []
    for _ in range(1, 20):
        d = pol.offer_due("suffix", "code", 8)
        due.append(d)
        if d:
            pol.offered("suffix", "code", 8, chosen=False)
    assert [s for s, d in enumerate(due, 1) if d] == [1, 2, 4, 8, 16]  # 2 misses, then probes after 2, 4, 8 idle steps
    assert pol.offer_due("suffix", "code", 1) and pol.offer_due("suffix", "chat", 8)
    assert not pol.offer_due("suffix", "code", 7)  # 7 requests: the calibrated batch size 8's cell
    assert policy_report.report(pol)["code"]["suffix_off_at_batch"] == [8]
    while not pol.offer_due("suffix", "code", 8):
        pass
    pol.offered("suffix", "code", 8, chosen=True)  # a probe that paid: on every step again
    assert all(pol.offer_due("suffix", "code", 8) for _ in range(5))
    pol.offered("suffix", "code", 8, chosen=False)
    pol.offered("suffix", "code", 8, chosen=False)
    assert not pol.offer_due("suffix", "code", 8)
    pol.reset()
    assert pol.offer_due("suffix", "code", 8)


class _CountingSuffix(SuffixCache):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.asked = 0

    def propose(self, request_id):
        self.asked += 1
        return super().propose(request_id)


def test_engine_under_load_stops_computing_suffix_proposals_it_never_chooses(tiny_target):
    """Rows so dear at batch 8 that no proposal can pay (an extra row costs 45 ms per request, a plain
    token 25 ms): after probe_every steps the batch's proposals are computed on probe steps only, the
    requests' own trees are never built after that, and the output is the target's."""
    cal = Calibration((100.0, 101.0, 102.0, 103.0), 2.0, "test", 128, (1, 8), (1, 2, 3, 4),
                      ((100.0, 101.0, 102.0, 103.0), (200.0, 560.0, 920.0, 1280.0)), (2.0, 4.0))
    pol = GoodputPolicy(cal, prior=0.0, probe_every=4)
    sfx = _CountingSuffix(max_depth=8)
    eng = Engine(
        tiny_target,
        None,
        EngineParams(num_draft_tokens=3, max_seq_len=256, max_batch=8, draft_early_stop=False),
        policy=pol,
        suffix=sfx,
    )
    ps = [[5 + i, 6, 7, 5 + i, 6, 7] for i in range(8)]
    ref = [
        Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256)).generate(p, 40).tokens for p in ps
    ]
    gens = eng.generate_batch([Request(p, 40, workload="code") for p in ps])
    assert [g.tokens for g in gens] == ref and all(len(g.tokens) == 40 for g in gens)
    assert sum(g.stats.num_drafts for g in gens) == 0
    # 39 decode steps of 8 requests: proposals in the first 4, then probes after 4, 8 and 16 idle steps
    assert sfx.asked == 8 * (4 + 3)
    assert policy_report.report(pol)["code"]["suffix_off_at_batch"] == [8]


def test_acceptance_starts_from_the_replayed_first_token_acceptance_worth_a_few_chains(tiny_target):
    """A class's a₁ starts from what the draft's evaluation replayed on it (else over all classes,
    else the prior) and is worth PRIOR_CHAINS observations: four rejections of a new draft lower it,
    they do not zero it (which left a class off until a probe). The replayed values are shrunk by
    their chains (a class replayed on 2 chains barely moves from the overall a₁). Engine.set_draft
    and the engine's constructor (what `tidespec serve` starts with) pass the replay."""
    from tidespec.engine.proposers.eagle3_estimate import PRIOR_CHAINS
    assert PRIOR_CHAINS == 4
    pol = GoodputPolicy(_cal(), prior=0.6, alpha=0.05)
    for _ in range(4):
        pol.estimator("eagle3").observe_chain("chat", 4, 0)
    assert pol.estimator("eagle3").acceptance("chat")[:2] == pytest.approx(
        [0.6 * 4 / 8, 0.6]
    )  # position 2 never reached
    overall = (396 * 0.5 + 4 * 0.6) / 400
    pol.reset({"code": (0.9, 96), "": (0.5, 396), "json": (0.0, 2), "math": (0.7, 0)})
    assert pol.estimator("eagle3").acceptance("code") == pytest.approx([(96 * 0.9 + 4 * overall) / 100, 0.6, 0.6, 0.6])
    assert pol.estimator("eagle3").acceptance("json")[0] == pytest.approx(4 * overall / 6)  # 2 rejected chains: not 0
    assert (
        pol.estimator("eagle3").acceptance("chat")[0]
        == pytest.approx(overall)
        == pol.estimator("eagle3").acceptance("math")[0]
    )
    assert pol.estimator("eagle3").tree_acceptance("code")[0] == 0.6  # trees: not the chains' replay
    a1 = pol.estimator("eagle3").acceptance("code")[0]
    pol.estimator("eagle3").observe_chain("code", 4, 0)
    assert pol.estimator("eagle3").acceptance("code")[0] == pytest.approx(a1 - a1 / 5)
    pol.reset()
    assert pol.estimator("eagle3").acceptance("code")[0] == 0.6
    eng = Engine(
        tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256, draft_early_stop=False), policy=pol
    )
    eng.set_draft(DraftRunner(random_draft(tiny_target, 64)), "v1", replayed={"": (0.3, 196.0), "code": (0.8, 116.0)})
    at = (196 * 0.3 + 4 * 0.6) / 200
    assert pol.estimator("eagle3").acceptance("code")[0] == pytest.approx((116 * 0.8 + 4 * at) / 120)
    assert pol.estimator("eagle3").acceptance("math")[0] == pytest.approx(at)
    with pytest.raises(ValueError, match=r"replayed\['code'\]"):  # nothing changes: v1 keeps serving
        eng.set_draft(DraftRunner(random_draft(tiny_target, 64)), "v2", replayed={"code": (float("nan"), 3)})
    assert eng.draft_version == "v1" and pol.estimator("eagle3").acceptance("math")[0] == pytest.approx(at)
    pol2 = GoodputPolicy(_cal(), prior=0.6)
    eng2 = Engine(
        tiny_target,
        DraftRunner(random_draft(tiny_target, 64)),
        EngineParams(num_draft_tokens=3, max_seq_len=256, draft_early_stop=False),
        policy=pol2,
        replayed={"": (0.2, 96.0)},
        draft_version="v3",
    )
    assert pol2.estimator("eagle3").acceptance("code")[0] == pytest.approx((96 * 0.2 + 4 * 0.6) / 100)
    assert eng2.health.against_replay("v3", "code").reference == 0.2  # draft health got the reference too


def test_served_reads_version_and_replay_from_the_draft_dir(tmp_path):
    """`workspace.served`: the keywords make_engine / set_draft take for a deployed draft dir."""
    import json

    from tidespec.workspace import served
    assert served(tmp_path) == {"version": None, "replayed": None}
    (tmp_path / "version.json").write_text(json.dumps({"version": "4", "replayed": {"": [0.5, 10], "code": [0.7, 3]}}))
    assert served(tmp_path) == {"version": "4", "replayed": {"": [0.5, 10.0], "code": [0.7, 3.0]}}


def test_a_step_whose_tries_matched_nothing_is_not_a_miss_of_the_suffix_gate():
    """Repetition comes in bursts: steps where no request of a class had a suffix proposal (empty
    ladders) do not count towards turning its proposals off; computed, offered and unchosen ones do."""
    pol = GoodputPolicy(_cal(), prior=0.6, probe_every=2)
    workloads = ["code"] * 8
    empty, offered = [ladder(eagle=(0.5,))] * 8, [ladder(eagle=(0.5,), suffix=(0.1, 0.15))] * 8
    for _ in range(10):
        pol.observe_offers(workloads, empty, [("", 0)] * 8)
    assert pol.offer_due("suffix", "code", 8) and pol.probes.gated_at("suffix", "code") == []
    for _ in range(2):
        pol.observe_offers(workloads, offered, [("", 0)] * 8)
    assert pol.probes.gated_at("suffix", "code") == [8]


def test_step_cost_memoises_the_calibration_and_forgets_it_when_replaced():
    """The plan asks StepCost the same (batch, rows) thousands of times per step, so it memoises the
    calibration's interpolations; a hot-swapped draft's costs (`cal` replaced) must not be served stale."""
    cost, cal = StepCost(_cal()), _cal()
    want = cal.target_cost(8, 12) + cal.draft_cost(8) + cal.draft_cost(4)
    assert cost.calibrated(8, 12, [8, 4]) == pytest.approx(want)
    assert cost.calibrated(8, 12, [8, 4]) == pytest.approx(want)  # now from the memo
    cost.cal = _cal(draft_ms=(3.0, 9.0))
    assert cost.calibrated(8, 12, [8]) == pytest.approx(cal.target_cost(8, 12) + 9.0)
    assert (cost.bucket(2), cost.bucket(3), cost.bucket(16)) == (1, 8, 8)  # nearest on a log scale


def test_a_cost_computed_from_the_old_calibration_never_lands_in_the_new_ones_memo():
    """`AdaptiveK.ensure_draft_costs` replaces `cost.cal` from another thread while a step may be
    planning: a value computed from the old calibration must not be served after the swap."""
    import threading
    from dataclasses import replace
    started, release = threading.Event(), threading.Event()

    class Slow(Calibration):
        def draft_cost(self, b):
            started.set()
            release.wait(5)
            return super().draft_cost(b)

    old = _cal(draft_ms=(0.0, 0.0))
    cost = StepCost(Slow(*(getattr(old, f) for f in old.__dataclass_fields__)))
    t = threading.Thread(target=cost._draft, args=(8,))
    t.start()
    assert started.wait(5)
    cost.cal = replace(old, draft_ms=3.0, draft_batch_ms=(3.0, 40.0))  # the swap, mid-computation
    release.set()
    t.join(5)
    assert cost._draft(8) == 40.0


def test_the_margin_rises_by_what_speculation_realized_of_its_predictions():
    """A plan predicted to gain 9.8 % speculates under the 5 % margin — until speculative steps
    realize 0.9 of their predicted tokens per ms while plain steps realize all of theirs: then it
    must predict 1.05 / ρ_spec, ρ_spec = 0.9 shrunk towards 1 by REALIZED_PRIOR steps (and aged by
    the plain steps since). Plain steps that realize less (the engine's own work, paid whatever the
    plan) lower it again; plain steps on time age the speculative evidence so speculation is tried
    again. Per calibrated batch size; forgotten on a hot-swap."""
    cal = Calibration((100.0, 101.0), 1.0, "test", 128, (1, 2), (1, 2), ((100.0, 101.0), (150.0, 160.0)), (1.0, 1.5))
    lad = ladder(eagle=(0.12,))
    pol = GoodputPolicy(cal, prior=0.6, probe_every=1000, margin=0.05, margin_off=0.05)
    assert pol.plan_step(["code"], [lad]) == [("eagle3", 1)]  # 1.12 × 100 / 102 = 1.098
    for _ in range(20):  # predicted 1.12 tokens in 102 ms; realized 1.12 tokens in 113.33 ms = 0.9
        pol.observe_realized(["code"], True, (1.12, 102.0), 1, 102.0 / 0.9 / 1.12)
    assert (
        pol.margins.margin_at(["code"], 1, 0.05) == 0.05
    )  # no plain step to compare with: the own work is not blamed on it
    pol.observe_realized(["code"], False, (1.0, 100.0), 1, 100.0)
    w = 20 * (1 - pol.config.alpha / 4)  # one plain step aged the speculative evidence once
    rho = (w * 0.9 + REALIZED_PRIOR) / (w + REALIZED_PRIOR)
    assert pol.margins.ratio("code", 1, True) == pytest.approx(rho)
    assert pol.margins.ratio("code", 1, False) == pytest.approx((1.0 + REALIZED_PRIOR) / (1 + REALIZED_PRIOR))
    assert pol.margins.margin_at(["code"], 1, 0.05) == pytest.approx(1.05 / rho - 1)  # 0.13
    assert pol.plan_step(["code"], [lad]) == [("", 0)]
    assert (
        pol.margins.ratio("code", 2, True) is None and pol.margins.margin_at(["code"], 2, 0.05) == 0.05
    )  # another batch size
    assert pol.margins.report() == {
        "code": {1: {"plain": 1.0, "speculative": round(rho, 4), "margin": round(1.05 / rho - 1, 4)}}
    }
    for _ in range(200):  # plain steps on time: the speculative evidence ages, the margin relaxes
        pol.observe_realized(["code"], False, (1.0, 100.0), 1, 100.0)
    assert 0.05 < pol.margins.margin_at(["code"], 1, 0.05) < 0.07 and pol.plan_step(["code"], [lad]) == [("eagle3", 1)]
    for _ in range(20):
        pol.observe_realized(["code"], True, (1.12, 102.0), 1, 102.0 / 0.9 / 1.12)
    for _ in range(40):  # plain steps realizing 0.5 (the engine's own work): the margin is the margin
        pol.observe_realized(["code"], False, (1.0, 100.0), 1, 200.0)
    assert pol.margins.margin_at(["code"], 1, 0.05) == 0.05
    before = pol.margins.ratio("code", 1, True)
    pol.observe_realized(["code"], True, (1.0, 100.0), 1, math.inf)  # ignored, as are non-positive values
    pol.observe_realized(["code"], True, (0.0, 100.0), 1, 100.0)
    assert pol.margins.ratio("code", 1, True) == before
    pol.reset()
    assert pol.margins.report() == {} and pol.margins.margin_at(["code"], 1, 0.05) == 0.05


def test_one_stalled_step_moves_the_realized_margin_never_decides_it():
    """Among 40 speculative steps on prediction, one that took 1000× its prediction (the machine
    stalled) counts as realizing ½ (REALIZED_CLIP), one step of the EMA: the margin moves by about
    a point, not to 121 % (a ratio of mean times let that one step's milliseconds dominate)."""
    pol = GoodputPolicy(_cal(), prior=0.6)
    for _ in range(20):
        pol.observe_realized(["math"] * 8, False, (8.0, 200.0), 8, 200.0)
    for _ in range(40):
        pol.observe_realized(["math"] * 8, True, (10.0, 250.0), 10, 250.0)
    assert pol.margins.margin_at(["math"], 8, 0.05) == 0.05
    pol.observe_realized(["math"] * 8, True, (10.0, 250.0), 10, 250_000.0)
    rho = ((20 * (1 - 0.05 / 2)) + REALIZED_PRIOR) / (20 + REALIZED_PRIOR)  # EMA 1 → 1 − 0.05·½
    assert pol.margins.ratio("math", 8, True) == pytest.approx(rho)
    assert (
        pol.margins.margin_at(["math"], 8, 0.05) == pytest.approx(1.05 / rho - 1)
        and pol.margins.margin_at(["math"], 8, 0.05) < 0.07
    )


def test_the_realized_margin_is_per_class_and_a_mixed_batch_clears_the_highest():
    """Code's plans at 8 requests realize their predictions, math's 0.9 of them: a math batch must
    clear 1.05 / ρ_math − 1, a code batch the margin alone, and a batch of both the higher. A step
    of both classes counts for each (pooled, code's steps had held math's margin at 5 %)."""
    pol = GoodputPolicy(_cal(), prior=0.6)
    for w in ("code", "math", "json"):
        for _ in range(20):
            pol.observe_realized([w] * 8, False, (8.0, 200.0), 8, 200.0)
    for _ in range(20):
        pol.observe_realized(["code"] * 8, True, (10.0, 250.0), 10, 250.0)
        pol.observe_realized(["math"] * 8, True, (10.0, 250.0), 9, 250.0)
        pol.observe_realized(["json"] * 8, True, (10.0, 250.0), 10, 263.0)
    w = 20.0  # no plain step since the speculative ones: nothing aged
    rho = (w * 0.9 + REALIZED_PRIOR) / (w + REALIZED_PRIOR)
    assert pol.margins.ratio("math", 8, True) == pytest.approx(rho)
    assert pol.margins.ratio("code", 8, True) == pytest.approx(1.0)
    assert pol.margins.margin_at(["code"] * 8, 8, 0.05) == 0.05
    assert pol.margins.margin_at(["math"] * 8, 8, 0.05) == pytest.approx(1.05 / rho - 1)
    assert 0.05 < pol.margins.margin_at(["json"] * 8, 8, 0.05) < pol.margins.margin_at(["math"] * 8, 8, 0.05)
    for mixed in (["code", "math"] * 4, ["math", "json"] * 4, ["json", "code", "math", "json"] * 2):
        assert pol.margins.margin_at(mixed, 8, 0.05) == pytest.approx(1.05 / rho - 1)  # the highest, whatever the order
    assert pol.margins.margin_at(["chat"] * 8, 8, 0.05) == 0.05  # a class never seen: the margin
    pol.observe_realized(["code", "math"] * 4, True, (10.0, 250.0), 5, 250.0)  # 0.5: counts for both
    assert pol.margins.ratio("code", 8, True) < 1.0 and pol.margins.ratio("math", 8, True) < rho
    assert set(pol.margins.report()) == {"code", "math", "json"} and set(pol.margins.report()["math"]) == {8}


def test_a_probe_skips_requests_whose_draft_has_a_long_backlog():
    """A probe's draft first catches up over the request's backlog (a long prompt: hundreds of rows):
    probes rotate over the idle requests with at most PROBE_BACKLOG prompt rows left to read (0 once
    read), and go to the one with the fewest when none has so few. At the default back-off (gaps
    of 32 … 512 steps) the rotation goes on: a probed request's prompt is read, whatever its
    backlog of decode rows since."""
    from tidespec.engine.policy.probes import PROBE_BACKLOG
    cal = Calibration((100.0, 101.0, 102.0, 103.0), 0.0, "test", 128, (1, 4), (1, 2, 3, 4),
                      ((100.0, 101.0, 102.0, 103.0), (150.0, 200.0, 250.0, 300.0)), (0.0, 0.0))

    def probed(backlogs):
        pol, out = GoodputPolicy(cal, prior=0.0, probe_every=1), []
        for _ in range(64):
            ch = pol.plan_step(["chat"] * 4, [ladder(eagle=(0.0, 0.0, 0.0))] * 4, prompt_backlogs=backlogs)
            out += [i for i, c in enumerate(ch) if c[1]]
        return out
    cheap = probed([500, 3, PROBE_BACKLOG, 300])
    assert len(cheap) >= 6 and set(cheap) == {1, 2} and min(cheap.count(1), cheap.count(2)) >= 2
    assert set(probed([500, 300, 400, 200])) == {3}
    pol, prompt, seen = GoodputPolicy(cal, prior=0.0, probe_every=32), [10, 20, 30, PROBE_BACKLOG + 1], []
    for _ in range(3000):
        ch = pol.plan_step(["chat"] * 4, [ladder(eagle=(0.0, 0.0, 0.0))] * 4, prompt_backlogs=list(prompt))
        for i in (i for i, c in enumerate(ch) if c[1]):
            prompt[i] = 0
            seen.append(i)
    assert set(seen[:3]) == {0, 1, 2} and set(seen) == {0, 1, 2}  # the long prompt is never read for a probe


def test_engine_probes_the_request_whose_draft_has_little_to_catch_up(tiny_target, monkeypatch):
    """Through the engine: the planner hands the policy each request's backlog rows (a 100-token
    prompt leaves its draft 100 rows to read, a 3-token one 3), so the first probe goes to the short
    one; both decode exactly as without a draft."""
    monkeypatch.setattr("tidespec.engine.policy.probes.PROBE_BACKOFF", 1)
    cal = Calibration((100.0, 101.0, 102.0, 103.0, 104.0), 1.0, "test", 256)
    long, short = [7 + i % 50 for i in range(100)], [5, 6, 7]
    ref = [
        Engine(tiny_target, None, EngineParams(num_draft_tokens=4, max_seq_len=256)).generate(p, 12).tokens
        for p in (long, short)
    ]
    pol = GoodputPolicy(cal, prior=0.0, probe_every=1)
    calls, plan_step = [], pol.plan_step
    pol.plan_step = lambda *a: calls.append((a[3], plan_step(*a))) or calls[-1][1]
    eng = Engine(
        tiny_target,
        DraftRunner(random_draft(tiny_target, 64)),
        EngineParams(num_draft_tokens=4, max_seq_len=256, max_batch=2, draft_early_stop=False),
        policy=pol,
    )
    gens = eng.generate_batch([Request(p, 12, workload="chat") for p in (long, short)])
    assert [g.tokens for g in gens] == ref
    assert calls[0][0] == [100, 3] and calls[0][1] == [("", 0), ("eagle3", 1)]


def test_the_plan_counts_the_drafts_catch_up_over_a_long_backlog(tiny_target):
    """Drafting now first runs the draft over the request's backlog (a prompt's rows): the plan
    charges (D(rows) − D(1)) / steps left. Here D(R) = 1 + 0.5 (R − 1) ms, one request, k = 1 with
    0.5 expected accepted: 1.5 / (102 + X) beats 1 / 100 by the 5 % margin while X < 40.8 ms."""
    cal = Calibration((100.0, 101.0), 1.0, "test", 128, (1, 2), (1, 2), ((100.0, 101.0), (150.0, 160.0)), (1.0, 1.5))
    cost = StepCost(cal)
    assert cost.catch_up_ms(101, 1) == pytest.approx(50.0) and cost.catch_up_ms(101, 2) == pytest.approx(25.0)
    assert cost.catch_up_ms(1, 1) == 0.0
    assert plan([ladder(eagle=(0.5,), catch_up_ms=30.0)], cost) == [("eagle3", 1)]
    assert plan([ladder(eagle=(0.5,), catch_up_ms=50.0)], cost) == [("", 0)]
    lad = ladder(eagle=(0.5,), catch_up_ms=50.0)
    assert predicted_step([lad], [("eagle3", 1)], cost) == (1.5, pytest.approx(102.0))  # not in the step's wall time
    # through the engine: the planner charges a 100-token prompt's catch-up, not a 1-token one's
    pol = GoodputPolicy(cal, prior=0.6, probe_every=1000)
    seen, plan_step = [], pol.plan_step
    pol.plan_step = lambda w, lads, *a: seen.append(lads) or plan_step(w, lads, *a)
    eng = Engine(
        tiny_target,
        DraftRunner(random_draft(tiny_target, 64)),
        EngineParams(num_draft_tokens=2, max_seq_len=256, max_batch=2, draft_early_stop=False),
        policy=pol,
    )
    ref = [
        Engine(tiny_target, None, EngineParams(num_draft_tokens=2, max_seq_len=256)).generate(p, 12).tokens
        for p in ([7 + i % 50 for i in range(100)], [5])
    ]
    gens = eng.generate_batch([Request(p, 12, workload="chat") for p in ([7 + i % 50 for i in range(100)], [5])])
    assert [g.tokens for g in gens] == ref
    assert [x.rung("eagle3").catch_up_ms for x in seen[0]] == [
        pytest.approx(cost.catch_up_ms(100, 11)),
        0.0,
    ]  # 11 tokens left
