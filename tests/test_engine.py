"""Engine: the lean target forward matches transformers; speculative greedy == target-only greedy."""
import pytest
import torch

from conftest import ladder, random_draft
from tidespec.bench import policy_report
from tidespec.config import EngineParams
from tidespec.engine.calibration import Calibration
from tidespec.engine.policy import GoodputPolicy
from tidespec.engine.sampling import SamplingParams
from tidespec.engine.speculative import Engine, Request
from tidespec.engine.stats import SpecDecodingStats, per_position, simulated_acceptance_length, tau_standard_error
from tidespec.models.runner import DraftRunner


def _random_runner(target, vd, seed=0):
    return DraftRunner(random_draft(target, vd, seed=seed))


def test_lean_forward_matches_transformers(tiny_target_dir, tiny_target):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    ids = torch.randint(3, 320, (17,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True)
    cache = tiny_target.new_cache(64)
    a = tiny_target.forward(ids[:9], cache)  # prefill then a multi-token block: cache positions
    b = tiny_target.forward(ids[9:], cache)
    torch.testing.assert_close(torch.cat([a.logits, b.logits]), ref.logits[0], atol=1e-4, rtol=1e-4)
    aux = torch.cat([ref.hidden_states[i + 1][0] for i in tiny_target.aux_layers], -1)  # output of layer i
    torch.testing.assert_close(torch.cat([a.aux, b.aux]), aux, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculative_equals_target_only_tiny(tiny_target, k):
    eng = Engine(tiny_target, _random_runner(tiny_target, 64), EngineParams(num_draft_tokens=k, max_seq_len=256))
    g = torch.Generator().manual_seed(k)
    for _ in range(4):
        prompt = torch.randint(3, 320, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        a = eng.generate(prompt, 48, speculative=False, capture=True)
        b = eng.generate(prompt, 48, speculative=True, capture=True)
        assert a.tokens == b.tokens
        assert b.stats.num_drafts > 0 and b.stats.num_draft_tokens == k * b.stats.num_drafts
        for key in ("input_ids", "loss_mask"):
            assert torch.equal(a.record[key], b.record[key])
        T = len(prompt) + len(a.tokens) - 1
        assert a.record["aux_hidden_states"].shape == (T, 3 * tiny_target.cfg.hidden_size)
        torch.testing.assert_close(a.record["hidden_states"], b.record["hidden_states"], atol=1e-4, rtol=1e-4)


def test_bad_input_is_refused_engine_keeps_serving(tiny_target):
    eng = Engine(tiny_target, _random_runner(tiny_target, 64), EngineParams(num_draft_tokens=3, max_seq_len=64))
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([], 8)
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.generate(list(range(3, 63)), 8)
    with pytest.raises(ValueError, match="k"):
        eng.generate([5, 6], 8, k=0)
    with pytest.raises(ValueError, match="token ids"):
        eng.generate([5, 999], 8)
    with pytest.raises(ValueError, match="temperature"):
        eng.generate([5, 6], 8, sampling=SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="top_p"):
        eng.generate([5, 6], 8, sampling=SamplingParams(temperature=1, top_p=0))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1, top_p=1.5)
    with pytest.raises(ValueError, match="empty prompt"):  # a bad request in a batch: nothing runs
        eng.generate_batch([Request([5, 6], 8), Request([], 8)])
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate([5, 6], 2.5)
    with pytest.raises(ValueError, match="k"):
        eng.generate([5, 6], 4, k=2.5)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(temperature=1, seed=2**70)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(temperature=1, top_k=2.5)
    with pytest.raises(ValueError):
        Engine(tiny_target, None, EngineParams(num_draft_tokens=0))
    with pytest.raises(ValueError, match="context"):
        Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=tiny_target.cfg.max_position + 1))
    assert len(eng.generate(list(range(3, 57)), 8, speculative=False, k=100).tokens) == 8  # k unused without a draft
    # a temperature too small for the softmax counts as greedy (vLLM's 1e-5), instead of NaN probabilities
    assert eng.generate([5, 6, 7], 8, sampling=SamplingParams(temperature=1e-45)).tokens == \
        eng.generate([5, 6, 7], 8).tokens
    assert eng.num_unfinished == 0
    assert len(eng.generate([5, 6, 7], 8).tokens) == 8


def _prompts(n, seed, lo=1, hi=20):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def test_batched_equals_alone(tiny_target):
    """Mixed batch (speculative or not, k 1..4, capture, sampling, different lengths) == each alone."""
    eng = Engine(
        tiny_target, _random_runner(tiny_target, 64), EngineParams(num_draft_tokens=3, max_seq_len=128, max_batch=8)
    )
    reqs = [Request(p, 20 + 3 * i, speculative=i % 3 != 0, k=1 + i % 4, capture=i % 2 == 0,
                    sampling=SamplingParams(temperature=0.8, top_p=0.9, seed=i) if i == 5 else SamplingParams())
            for i, p in enumerate(_prompts(7, 1))]
    alone = [eng.generate_batch([r])[0] for r in reqs]
    batch = eng.generate_batch(reqs)
    for a, b, r in zip(alone, batch, reqs):
        assert a.tokens == b.tokens and len(b.tokens) == r.max_new_tokens
        if r.capture:
            torch.testing.assert_close(a.record["aux_hidden_states"], b.record["aux_hidden_states"], atol=0, rtol=0)
        assert a.stats.num_accepted_tokens == b.stats.num_accepted_tokens
    assert sum(g.stats.num_drafts for g in batch) > 0


def test_requests_join_and_leave_between_steps(tiny_target):
    eng = Engine(
        tiny_target, _random_runner(tiny_target, 64), EngineParams(num_draft_tokens=2, max_seq_len=128, max_batch=2)
    )
    ps = _prompts(4, 2)
    ref = [eng.generate(p, 12 + 4 * i, speculative=False).tokens for i, p in enumerate(ps)]
    futs = [eng.submit(Request(ps[0], 12)), eng.submit(Request(ps[1], 16))]
    eng.step()
    eng.step()
    futs.append(eng.submit(Request(ps[2], 20)))  # waits: max_batch = 2
    assert eng.num_unfinished == 3 and len(eng._running) == 2
    finished = []
    while not all(f.done() for f in futs):
        finished += eng.step()
        if len(futs) == 3 and futs[0].done():
            futs.append(eng.submit(Request(ps[3], 24)))  # joins after the first left
    assert [f.result().tokens for f in futs] == ref
    assert {g.request_id for g in finished} == {f.result().request_id for f in futs}
    assert eng.num_unfinished == 0


def test_threads_calling_generate_share_steps(tiny_target, monkeypatch):
    """Four client threads at once: every caller steps all running requests (target forwards carry
    several requests' segments, fewer forwards than the requests alone took); outputs as alone."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    eng = Engine(
        tiny_target, _random_runner(tiny_target, 64), EngineParams(num_draft_tokens=3, max_seq_len=128, max_batch=4)
    )
    ps = _prompts(4, 4)
    segs, real = [], tiny_target.forward_batch
    monkeypatch.setattr(tiny_target, "forward_batch", lambda ss, *a, **kw: segs.append(len(ss)) or real(ss, *a, **kw))
    ref = [eng.generate(p, 24).tokens for p in ps]
    alone, segs[:] = len(segs), []
    start = threading.Barrier(4)
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda p: (start.wait(), eng.generate(p, 24).tokens)[1], ps))
    assert got == ref and eng.num_unfinished == 0
    assert max(segs) > 1 and len(segs) < alone, (segs, alone)


def test_one_requests_error_does_not_fail_its_batch_mates(tiny_target, monkeypatch):
    import tidespec.engine.accept as spec
    eng = Engine(tiny_target, _random_runner(tiny_target, 64), EngineParams(num_draft_tokens=2, max_seq_len=64))
    ref = eng.generate([5, 6, 7], 10).tokens
    monkeypatch.setattr(spec, "rejection_verify", lambda *a: (_ for _ in ()).throw(RuntimeError("sampler bug")))
    bad = eng.submit(Request([8, 9], 10, sampling=SamplingParams(temperature=1.0, seed=0)))
    good = eng.submit(Request([5, 6, 7], 10))
    while not (bad.done() and good.done()):
        eng.step()
    with pytest.raises(RuntimeError, match="sampler bug"):
        bad.result()
    assert good.result().tokens == ref


def test_a_failed_forward_still_resolves_requests_aborted_in_the_same_step(tiny_target, monkeypatch):
    """The shared forward fails in the step that also retires an aborted request: the aborted one
    resolves (finish_reason abort), the running one fails with the error; none hangs."""
    eng = Engine(tiny_target, None, EngineParams(num_draft_tokens=2, max_seq_len=64))
    gone, running = eng.submit(Request([5, 6], 8, request_id="gone")), eng.submit(Request([7, 8], 8))
    eng.step()  # both admitted and prefilled
    assert eng.abort("gone")
    monkeypatch.setattr(tiny_target, "forward_batch", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("oom")))
    eng.step()
    assert gone.done() and running.done()
    assert gone.result().finish_reason == "abort"
    with pytest.raises(RuntimeError, match="oom"):
        running.result()


def test_cancelled_request_is_dropped_and_callbacks_may_reenter(tiny_target):
    import threading
    eng = Engine(tiny_target, None, EngineParams(num_draft_tokens=2, max_seq_len=64))
    ref = eng.generate([5, 6], 6).tokens
    a, b = eng.submit(Request([5, 6], 6)), eng.submit(Request([5, 6], 6))
    assert a.cancel()
    seen = []
    b.add_done_callback(lambda f: seen.append(eng.generate([5, 6], 6).tokens))  # runs inside step()
    t = threading.Thread(target=lambda: [eng.step() for _ in range(12)], daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "step() deadlocked on a re-entrant done-callback"
    assert b.result().tokens == ref and seen == [ref] and a.cancelled() and eng.num_unfinished == 0


def test_seeded_sampling_is_reproducible_with_adaptive_k(tiny_target):
    pol = GoodputPolicy(_cal([100, 104, 108], 2), prior=0.9, alpha=0.5)
    eng = Engine(
        tiny_target,
        _random_runner(tiny_target, 64),
        EngineParams(num_draft_tokens=2, max_seq_len=128, draft_early_stop=False),
        policy=pol,
    )
    sp = SamplingParams(temperature=1.0, top_p=0.95, seed=7)
    first = eng.generate([5, 6, 7], 30, sampling=sp).tokens
    for _ in range(3):  # the policy's state moves between runs; a seeded request keeps the engine's k
        eng.generate([9, 10], 30)
        assert eng.generate([5, 6, 7], 30, sampling=sp).tokens == first


def test_error_in_a_step_fails_its_requests_engine_keeps_serving(tiny_target, monkeypatch):
    eng = Engine(tiny_target, None, EngineParams(num_draft_tokens=2, max_seq_len=64))
    fut = eng.submit(Request([5, 6], 4))
    monkeypatch.setattr(eng.target, "forward_batch", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    eng.step()
    with pytest.raises(RuntimeError, match="boom"):
        fut.result()
    monkeypatch.undo()
    assert len(eng.generate([5, 6], 4).tokens) == 4


def _cal(target_ms, draft_ms):
    return Calibration(tuple(target_ms), draft_ms, "test", 128)


def predicted_tau(acc: list[float], k: int) -> float:
    """τ(k) = 1 + Σ_{i≤k} Π_{j≤i} a_j."""
    return simulated_acceptance_length(acc[:k])


def _alone(pol, workload: str) -> int:
    """The chain k the policy gives one request of the class running alone this step (probes included)."""
    return pol.plan_step([workload], [ladder(eagle=pol.estimator("eagle3").gains(workload))])[0][1]


def test_adaptive_k_cost_model_and_off_switch():
    cal = _cal([100, 110, 120, 130, 140], 5)  # T_target(n) for n = 1..5, T_draft 5 ms
    pol = GoodputPolicy(cal, prior=0.9, alpha=1.0, probe_every=4)
    assert predicted_tau([0.9, 0.9], 2) == pytest.approx(1 + 0.9 + 0.81)
    tps = policy_report.predicted_tokens_per_s(pol, "code")
    assert tps[0] == pytest.approx(10.0)
    assert tps[4] == pytest.approx(1000 * predicted_tau([0.9] * 4, 4) / (140 + 20))
    assert _alone(pol, "code") == 4
    pol.estimator("eagle3").observe_chain("code", 4, 1)  # alpha 1: a = [1, 0, prior, prior]
    assert pol.estimator("eagle3").acceptance("code") == pytest.approx([1.0, 0.0, 0.9, 0.9])
    assert policy_report.best_k(pol, "code") == 1  # τ(1) = 2 for 115 ms beats everything else
    pol.estimator("eagle3").observe_chain("chat", 2, 0)  # a1 = 0: nothing beats plain decoding
    ks = [_alone(pol, "chat") for _ in range(12)]
    assert ks == [0, 0, 0, 1] + [0] * 7 + [1]  # off, with probes (best k >= 1) after 4, then 8 idle steps
    assert policy_report.report(pol)["chat"]["speculation"] is False and policy_report.report(pol)["code"]["k"] == 1
    pol.reset()
    assert pol.estimator("eagle3").acceptance("code") == [0.9] * 4
    slow = GoodputPolicy(cal, prior=0.9, alpha=0.05)
    for n in (1, 0, 0, 0):  # the first 1/alpha observations are averaged with the prior's 4 (PRIOR_CHAINS)
        slow.estimator("eagle3").observe_chain("x", 1, n)
    assert slow.estimator("eagle3").acceptance("x")[0] == pytest.approx((4 * 0.9 + 1) / 8)
    policy_report.observe_time(pol, 0, 1e6)  # a load spike at most doubles the estimate
    assert policy_report.step_ms(pol)[0] <= 2 * 100 * 1.0001
    for bad in ([100], [100, 0], [100, float("nan")]):  # k_max 0, zero or non-finite costs
        with pytest.raises(ValueError, match="calibration"):
            _cal(bad, 5)
    policy_report.observe_time(pol, 1, float("inf"))  # ignored
    assert all(x == x and x < 1e9 for x in policy_report.step_ms(pol))
    # measured step times replace the calibration; unmeasured k scale by the observed load
    policy_report.observe_time(pol, 0, 200.0, alpha=1.0)  # plain decoding measured 2x slower than calibrated
    assert policy_report.step_ms(pol) == pytest.approx([200, 230, 260, 290, 320])
    policy_report.observe_time(pol, 2, 130.0, alpha=1.0)  # k = 2 measured at 130 ms: load = 130 / 130 = 1
    # per-k estimates 200, 115, 130, 145, 160 — but a step with k drafts costs at least T(0) × the
    # calibrated T(k)/T(0): k = 0 measured slow means every k is at least as slow
    assert policy_report.step_ms(pol) == pytest.approx([200, 230, 260, 290, 320])
    policy_report.observe_time(pol, 0, 100.0, alpha=1.0)
    assert policy_report.step_ms(pol) == pytest.approx([100, 115, 130, 145, 160])


def test_adaptive_k_margin_keeps_break_even_classes_off():
    cal = _cal([100, 100], 0)  # k = 1 costs what plain decoding costs: τ(1) = 1 + a1 is the gain
    for margin, a1, k in ((0.05, 0.03, 0), (0.0, 0.03, 1), (0.05, 0.06, 1)):
        pol = GoodputPolicy(cal, prior=a1, alpha=1.0, margin=margin)
        assert policy_report.best_k(pol, "chat") == k, (margin, a1)
        assert policy_report.report(pol) == {} and _alone(pol, "chat") == k
    with pytest.raises(ValueError, match="margin"):
        GoodputPolicy(cal, margin=1.0)


def test_adaptive_engine_is_lossless_and_learns(tiny_target):
    cal = _cal([100, 104, 108, 112, 116], 2)
    pol = GoodputPolicy(cal, prior=0.9, alpha=0.2, probe_every=8)
    eng = Engine(
        tiny_target,
        _random_runner(tiny_target, 64),
        EngineParams(num_draft_tokens=4, max_seq_len=256, draft_early_stop=False),
        policy=pol,
    )
    ps = _prompts(6, 3)
    ref = [eng.generate(p, 40, speculative=False).tokens for p in ps]
    gens = eng.generate_batch([Request(p, 40, workload="code") for p in ps])
    assert [g.tokens for g in gens] == ref
    # a random draft is almost never accepted: the policy learns to switch speculation off, but probes
    rep = policy_report.report(pol)["code"]
    assert rep["k"] == 0 and rep["predicted_speedup"] == 1.0
    assert pol.estimator("eagle3").acceptance("code")[0] < 0.3
    assert 0 < sum(g.stats.num_drafts for g in gens) < sum(len(g.tokens) for g in gens) / 2


def test_draft_of_other_target_is_refused(tiny_target):
    eng = Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=64))
    r = _random_runner(tiny_target, 64)
    object.__setattr__(r.config, "target_id", "0" * 64)
    with pytest.raises(ValueError, match="trained for target"):
        eng.set_draft(r, "x")
    assert eng.draft_version is None


def test_stats_math():
    s = SpecDecodingStats(4)
    s.observe(4, 4)
    s.observe(4, 1)
    s.observe(4, 0)
    assert s.acceptance_length == pytest.approx(1 + 5 / 3)
    assert s.acceptance_rate == pytest.approx(5 / 12)
    assert s.accepted_per_pos == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert simulated_acceptance_length([0.5, 0.5]) == pytest.approx(1.75)
    # the three steps accepted 4, 1, 0: the sample's own variance (population form) over its size
    xs = [4, 1, 0]
    var = sum(x * x for x in xs) / 3 - (sum(xs) / 3) ** 2
    assert tau_standard_error(s.accepted_per_pos, s.num_drafts) == pytest.approx((var / 3) ** 0.5)
    m = s.metrics() | {"accepted_per_pos/7": 0.5}  # a gap: position 7 without 4..6 is not read
    assert per_position(m) == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3]) and per_position({}) == []
    assert tau_standard_error([1.0, 1.0], 50) == 0.0 and tau_standard_error([0.3], 0) == 0.0  # no spread; no steps


# -- real target (SmolLM2-135M): run once in CI ----------------------------------------------------
PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n",
           "Explain what a hash table is in two sentences.",
           "List three prime numbers greater than 100 as JSON.",
           "from typing import List\n\ndef mean(xs: List[float]) -> float:\n"]


def test_replay_interleaves_configs_and_counts_mismatches(tiny_target):
    from tidespec.engine.replay import replay
    order = []

    class Spy(Engine):
        def generate_batch(self, reqs):
            order.append((self.draft_version, len(reqs)))
            return super().generate_batch(reqs)

    ps = [{"id": str(i), "input_ids": p} for i, p in enumerate(_prompts(3, 5))]
    cfg = EngineParams(num_draft_tokens=3, max_seq_len=128)
    base, spec = Spy(tiny_target, None, cfg), Spy(tiny_target, _random_runner(tiny_target, 64), cfg, draft_version="d")
    runs = replay({"base": (base, False), "spec": (spec, True)}, ps, 12, reference="base")
    assert order == [(None, 1), ("d", 1)] * 3  # prompt by prompt, every config in turn
    assert runs["spec"]["outputs"] == runs["base"]["outputs"] and runs["spec"]["metrics"]["mismatches"] == 0
    assert runs["spec"]["metrics"]["num_drafts"] > 0 and runs["base"]["metrics"]["new_tokens"] == 36
    order.clear()  # concurrency 2: waves of two requests in one engine batch, configs still interleaved
    runs2 = replay({"base": (base, False), "spec": (spec, True)}, ps, 12, reference="base", concurrency=2)
    assert order == [(None, 2), ("d", 2), (None, 1), ("d", 1)]
    assert runs2["spec"]["outputs"] == runs["base"]["outputs"] and runs2["spec"]["metrics"]["mismatches"] == 0


def test_replay_reports_tau_and_its_standard_error_per_workload():
    """`tau_se/<workload>` is `stats.tau_standard_error` of that workload's own per-position acceptance
    and chains (not the pooled ones); a workload without a chain gets none."""
    from types import SimpleNamespace

    from tidespec.engine.replay import replay
    from tidespec.engine.stats import RequestTiming, SpecDecodingStats, tau_standard_error
    accepted = {"code": [3, 2, 3, 1], "chat": [0, 1, 0, 0], "math": []}  # accepted drafts per chain, k = 3

    class Fake:
        cfg = SimpleNamespace(num_draft_tokens=3)

        def generate_batch(self, reqs):
            out = []
            for r in reqs:
                st = SpecDecodingStats(3)
                for n in accepted[r.workload]:
                    st.observe(3, n)
                out.append(SimpleNamespace(tokens=[1, 2], stats=st, timing=RequestTiming()))
            return out
    ps = [{"id": w, "input_ids": [5], "workload": w} for w in accepted]
    m = replay({"spec": (Fake(), True)}, ps, 2)["spec"]["metrics"]
    for w in ("code", "chat"):
        xs = accepted[w]
        per = [sum(x > i for x in xs) / len(xs) for i in range(3)]
        assert m[f"acceptance_length/{w}"] == pytest.approx(1 + sum(xs) / len(xs))
        assert m[f"tau_se/{w}"] == pytest.approx(tau_standard_error(per, len(xs)))
    assert m["tau_se/code"] == pytest.approx(((9 + 4 + 9 + 1) / 4 - 2.25 ** 2) ** 0.5 / 2)  # sqrt(Var X / n)
    assert m["tau_se/chat"] == pytest.approx(((1 / 4 - (1 / 4) ** 2) / 4) ** 0.5)
    assert "tau_se/math" not in m


class _Sink:
    """A capture sink that wants every other request (or raises at admission)."""

    def __init__(self, fail: bool = False):
        self.asked, self.got, self.fail = [], [], fail

    def wants(self, rid):
        self.asked.append(rid)
        if self.fail:
            raise OSError("disk gone")
        return len(self.asked) % 2 == 1

    def submit_generation(self, g, workload="default", prompt_id=""):
        self.got.append((g.request_id, workload, prompt_id))
        return True


def test_capture_sink_is_asked_once_at_admission_and_fed_at_finish(tiny_target):
    """The engine owns capture: `wants` once per request at admission; a wanted request's record goes
    to the sink (once, with its workload and prompt id), an unwanted one collects no hidden states;
    capture=False never asks; a sink failing at admission leaves the request served, uncaptured."""
    sink = _Sink()
    eng = Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256), capture=sink)
    gens = [eng.generate([5, 17, 33, i + 3], 6, request_id=f"r{i}", workload="code", prompt_id=f"p{i}")
            for i in range(4)]
    assert sink.asked == ["r0", "r1", "r2", "r3"]
    assert sink.got == [("r0", "code", "p0"), ("r2", "code", "p2")]
    assert [g.record is not None for g in gens] == [True, False, True, False]
    eng.generate([5, 17, 33], 4, capture=False, request_id="never")
    assert "never" not in sink.asked
    bad = Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256), capture=_Sink(fail=True))
    g = bad.generate([5, 17, 33], 4)
    assert g.record is None and len(g.tokens) == 4


def test_adaptive_cost_model_survives_step_time_spikes():
    """Injected spikes on plain-decoding steps (a busy machine while k = 0 ran) and quiet draft steps
    must not make the policy predict more than τ(k): a step with more drafts never costs less."""
    import random
    cal = _cal([50, 55, 60, 65, 70], 3)
    pol = GoodputPolicy(cal, prior=0.05, probe_every=4)  # a weak draft: τ(4) ≈ 1.05
    rng = random.Random(0)
    for _ in range(300):
        spike = 8.0 if rng.random() < 0.5 else 1.0  # half the k = 0 steps hit a spike
        policy_report.observe_time(pol, 0, 50 * spike)
        policy_report.observe_time(pol, 4, 60.0)  # draft steps measured on a quiet machine
    tps = policy_report.predicted_tokens_per_s(pol, "static")
    tau4 = predicted_tau([0.05] * 4, 4)
    bound = [predicted_tau([0.05] * k, k) * cal.step_ms(0) / cal.step_ms(k) for k in range(5)]
    assert all(tps[k] / tps[0] <= bound[k] + 1e-9 for k in range(1, 5))  # ≤ τ(k)·T(0)/T(k): never 3.9×
    assert max(tps[k] / tps[0] for k in range(1, 5)) < tau4 < 1.06
    assert policy_report.best_k(pol, "static") == 0  # and below the margin: speculation stays off
    ms = policy_report.step_ms(pol)
    assert all(a <= b for a, b in zip(ms, ms[1:]))


def test_each_refusal_names_the_request_field_it_is_about(tiny_target):
    """`InvalidRequest.field` is what a server maps to its own parameter (no guessing from the message)."""
    from tidespec.engine.invalid import InvalidRequest
    eng = Engine(tiny_target, None, EngineParams(num_draft_tokens=2, max_seq_len=64))
    cases = {
        "prompt_ids": [Request([], 4), Request([5, 999], 4)],
        "max_new_tokens": [Request([5], 0), Request([5] * 40, 30)],
        "k": [Request([5], 4, k=0)],
        "logit_bias": [Request([5], 4, sampling=SamplingParams(logit_bias={999: 1.0}))],
        "stop_token_ids": [Request([5], 4, sampling=SamplingParams(stop_token_ids=(999,)))],
        "workload": [Request([5], 4, workload=3)],
    }
    for field, reqs in cases.items():
        for r in reqs:
            with pytest.raises(InvalidRequest) as e:
                eng.submit(r)
            assert e.value.field == field, (field, r, str(e.value))
