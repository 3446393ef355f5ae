"""Drafts per workload class on the embedded engine: each request starts with its class's draft or the
generalist, outputs stay equal to target-only, swaps are per class, the resident drafts stay within
engine.draft_memory_mb."""
import pytest
import torch

from conftest import random_draft
from tidespec.config import EngineParams
from tidespec.engine.drafts import GENERALIST, priors
from tidespec.engine.speculative import Engine, Request
from tidespec.models.runner import DraftRunner

CFG = EngineParams(num_draft_tokens=3, max_seq_len=256, adaptive=False)


def _prompts(n, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (int(torch.randint(2, 16, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _run(eng, prompts, workloads):
    return eng.generate_batch([Request(p, 24, workload=w) for p, w in zip(prompts, workloads)])


def test_each_class_drafts_with_its_own_draft_and_outputs_equal_target_only(tiny_target):
    gen, code = (DraftRunner(random_draft(tiny_target, 64, seed=s)) for s in (0, 1))
    eng = Engine(tiny_target, gen, CFG, draft_version="1")
    eng.set_draft(code, "7", workload="code")
    assert eng.draft_versions == {GENERALIST: "1", "code": "7"} and eng.draft_version == "1"
    prompts = _prompts(6, 0)
    wls = ["code", "chat", "code", "math", "code", "chat"]
    got = _run(eng, prompts, wls)
    assert [g.draft_version for g in got] == ["7" if w == "code" else "1" for w in wls]
    plain = Engine(tiny_target, None, CFG).generate_batch([Request(p, 24, speculative=False) for p in prompts])
    assert [g.tokens for g in got] == [g.tokens for g in plain]  # lossless whichever draft drafted
    # the code requests' catch-up rows went to the code draft, the others' to the generalist
    fed = {"code": 0, "gen": 0}
    for name, r in (("code", code), ("gen", gen)):
        def counting(items, _orig=r.extend_batch, _name=name):
            fed[_name] += sum(len(t) for _, t, _ in items)
            return _orig(items)
        r.extend_batch = counting
    got = _run(eng, prompts, wls)
    rows = [sum(len(p) for p, w in zip(prompts, wls) if (w == "code") == is_code) for is_code in (True, False)]
    assert fed["code"] >= rows[0] and fed["gen"] >= rows[1]  # each at least its requests' prompts
    assert fed["code"] < rows[0] + 3 * 24 and fed["gen"] < rows[1] + 3 * 24  # and nothing of the others'


def test_a_class_swap_leaves_other_classes_and_falls_back_to_the_generalist(tiny_target):
    gen, code, code2 = (DraftRunner(random_draft(tiny_target, 64, seed=s)) for s in (0, 1, 2))
    eng = Engine(tiny_target, gen, CFG, draft_version="1")
    eng.set_draft(code, "7", workload="code")
    eng.set_draft(code2, "9", workload="code")
    assert eng.draft_versions == {GENERALIST: "1", "code": "9"}
    assert eng.health.previous("9") == "7" and eng.health.previous("7") == "1"  # a class's first: the generalist
    eng.set_draft(None, workload="code")
    assert _run(eng, _prompts(1, 2), ["code"])[0].draft_version == "1"
    eng.set_draft(None)  # no generalist: a class draft still drafts for its class, others do not speculate
    eng.set_draft(code, "7", workload="code")
    got = _run(eng, _prompts(2, 1), ["code", "chat"])
    assert [g.draft_version for g in got] == ["7", None] and got[1].stats.num_drafts == 0


def test_resident_drafts_stay_within_the_memory_budget(tiny_target):
    gen, code, chat = (DraftRunner(random_draft(tiny_target, 64, seed=s)) for s in (0, 1, 2))
    mib = gen.weight_bytes / 2**20
    own = sum(t.numel() * t.element_size() for t in gen.draft.state_dict().values())
    assert own <= gen.weight_bytes <= 3 * own  # weights + fused/prepacked copies, the shared embedding not counted
    eng = Engine(tiny_target, gen, CFG.model_copy(update={"draft_memory_mb": 2.5 * mib}), draft_version="1")
    eng.set_draft(code, "7", workload="code")
    with pytest.raises(ValueError, match="engine.draft_memory_mb"):
        eng.set_draft(chat, "8", workload="chat")
    assert eng.draft_versions == {GENERALIST: "1", "code": "7"}  # nothing changed
    eng.set_draft(chat, "8", workload="code")  # a replacement counts once
    with pytest.raises(ValueError, match="engine.draft_memory_mb"):
        Engine(tiny_target, gen, CFG.model_copy(update={"draft_memory_mb": 0.5 * mib}))


def test_the_policy_prior_of_a_class_comes_from_the_draft_serving_it():
    served = {GENERALIST: (None, "1", {"": (0.5, 100), "code": (0.4, 50), "chat": (0.6, 50)}),
              "code": (None, "7", {"": (0.7, 80), "code": (0.8, 60)}),
              "math": (None, "8", None)}
    assert priors(served) == {"": (0.5, 100), "code": (0.8, 60), "chat": (0.6, 50)}


def test_the_guard_rolls_back_a_class_draft_clearly_below_the_generalist_on_its_class(tiny_target):
    """The generalist v1 drafts code and chat (τ 1.5 there: one of k = 3 accepted every other chain);
    code's own draft v7 is never accepted: its first windows, clearly below v1's latest on code, make
    the guard ask the same-traffic evidence (here a judge saying v1 is clearly better on code's recent
    records) and roll v7 back on its class; the report flags it against its predecessor."""
    from tidespec.engine.health import PairedComparison
    from tidespec.serve.draft_health import EngineSource, HealthReport
    from tidespec.serve.guard import LiveGuard
    from tidespec.serve.judge import TeacherForced
    from tidespec.serve.metrics import ServeMetrics
    gen, code = (DraftRunner(random_draft(tiny_target, 64, seed=s)) for s in (0, 1))
    eng = Engine(tiny_target, gen, CFG, draft_version="1")
    calls, judged, metrics = [], [], ServeMetrics(3)
    guard = LiveGuard(EngineSource(eng), TeacherForced(
        lambda v, prev, w: judged.append((v, prev, w)) or PairedComparison(0.4, 0.1, 16)),
        lambda *a: calls.append(a) or "1")
    report = HealthReport(eng, metrics, every_s=0)

    def rounds(version: str, classes: tuple[str, ...], accepted, n: int = 3) -> list[str]:
        actions = guard.check()
        for _ in range(n):
            for w in classes:
                for i in range(120):
                    eng.health.observe(version, w, accepted(i), 3)
            actions += guard.check()
        return actions

    assert rounds("1", ("code", "chat"), lambda i: i % 2) == []  # healthy: its own reference, nothing to do
    eng.set_draft(code, "7", workload="code")
    assert rounds("7", ("code",), lambda i: 0) == ["trial", "rolled_back"]
    assert len(calls) == 1 and calls[0][0] == "7" and calls[0][2] == "code" and "below v1's latest 1.500" in calls[0][1]
    assert judged == [("7", "1", "code")]  # scored against the generalist on code's traffic
    assert "teacher-forced on the same recent traffic: v1 − v7 = +0.400" in calls[0][1]
    assert [(v.version, v.workload) for v in report.check()] == [("7", "code")]
    assert metrics.registry.get_sample_value("tidespec:draft_regressed",
                                             {"against": "previous", "version": "7", "workload": "code"}) == 1.0
