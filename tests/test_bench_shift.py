"""bench shift: batched side-by-side measurement, summary against the goals, report + plots (tiny target).

The full experiment (`tidespec bench shift`) needs SmolLM2 and ~45 min; here its pieces run on the
tiny target with real engines: outputs of every arm and concurrency must equal target-only.
"""
import json

import pytest

from conftest import random_draft
from tidespec.bench import shift
from tidespec.config import EngineParams, Params
from tidespec.engine.speculative import Engine


@pytest.fixture(scope="module")
def arms(tiny_target):
    d = random_draft(tiny_target, seed=3)
    from tidespec.models.runner import DraftRunner
    return {
        "none": (Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256, max_batch=4)), False),
        "static": (
            Engine(tiny_target, DraftRunner(d), EngineParams(num_draft_tokens=3, max_seq_len=256, max_batch=4)),
            True,
        ),
        "adapted": (
            Engine(
                tiny_target,
                DraftRunner(random_draft(tiny_target, seed=4)),
                EngineParams(num_draft_tokens=3, max_seq_len=256, max_batch=4),
            ),
            True,
        ),
    }


def _prompts(n, phase, seed=0):
    import torch
    g = torch.Generator().manual_seed(seed)
    return [{"id": f"{phase}/{i}", "input_ids": torch.randint(3, 300, (6 + i,), generator=g).tolist(),
             "workload": phase} for i in range(n)]


def test_measure_is_lossless_at_every_concurrency(arms):
    cfg = shift.ShiftConfig(concurrency=(1, 3), max_new_tokens=10)
    m = shift.measure(arms, _prompts(5, "code"), cfg, None)
    ref = m["reference"]
    assert len(ref) == 5 and all(len(t) == 10 for t in ref.values())
    for c in (1, 3):
        row = m["by_concurrency"][c]
        assert set(row) == {"none", "static", "adapted"}
        for name, r in row.items():
            assert r["mismatches"] == 0, (c, name)
            assert r["new_tokens"] == 50 and r["tokens_per_s"] > 0
        assert row["none"]["acceptance_length"] == 1.0
        assert 1.0 <= row["static"]["acceptance_length"] <= 4.0
    # the same draft gives the same τ whatever the batching (greedy, identical streams)
    assert m["by_concurrency"][1]["static"]["acceptance_length"] == pytest.approx(
        m["by_concurrency"][3]["static"]["acceptance_length"])
    after = shift.measure({k: v for k, v in arms.items() if k != "none"}, _prompts(5, "code"), cfg, ref)
    assert all(r["mismatches"] == 0 for c in (1, 3) for r in after["by_concurrency"][c].values())


@pytest.fixture(scope="module")
def arms_hybrid(arms, tiny_target):
    from tidespec.engine.calibration import Calibration
    from tidespec.engine.policy import GoodputPolicy
    from tidespec.engine.suffix_tree import SuffixCache
    from tidespec.models.runner import DraftRunner
    pol = GoodputPolicy(Calibration((10.0, 10.5, 11.0, 11.5), 0.5, "test", 128))
    hy = Engine(
        tiny_target,
        DraftRunner(random_draft(tiny_target, seed=4)),
        EngineParams(num_draft_tokens=3, max_seq_len=256, max_batch=4, draft_early_stop=True),
        policy=pol,
        suffix=SuffixCache(max_depth=8),
    )
    return arms | {"hybrid": (hy, True)}


def test_hybrid_arm_serves_the_champions_corpus(tiny_target, tmp_path):
    from tidespec.engine.suffix_tree import CORPUS_FILE, save_corpus
    from tidespec.models.eagle3 import save_checkpoint
    save_checkpoint(random_draft(tiny_target, seed=4), tmp_path / "champion")
    save_corpus(tmp_path / "champion" / CORPUS_FILE, [[5, 6, 7, 8, 9]])
    p = Params()
    p = p.model_copy(update={"engine": p.engine.model_copy(update={"max_seq_len": 256})})
    arms = shift._arms(tiny_target, p, {"none": None}, tmp_path / "champion")
    eng, spec = arms["hybrid"]
    assert spec and eng.policy is not None and eng.cfg.draft_early_stop and eng.suffix.retained_tokens == 5
    assert arms["none"][0].suffix is None and not arms["none"][1]


def test_summary_report_and_plots(arms_hybrid, tmp_path):
    arms = arms_hybrid
    cfg = shift.ShiftConfig(phases=("chat", "code"), concurrency=(1, 2), max_new_tokens=8)
    rep = {"config": {"phases": list(cfg.phases), "eval_prompts": 3, "max_new_tokens": 8}, "k": 3, "cpu_threads": 2,
           "wall_s": 12.0, "phases": [], "cycles": [
               {"phase": "chat", "snapshot": "s1", "snapshot_tokens": 900, "cycle_s": 130.0, "promoted": True,
                "version": "2", "reason": "r", "candidate_tau": 1.4, "champion_tau": 1.2, "drift_jsd": None,
                "train_s": 60.0},
               {"phase": "code", "snapshot": "s2", "snapshot_tokens": 950, "cycle_s": 700.0, "promoted": False,
                "version": "3", "reason": "r", "candidate_tau": 1.1, "champion_tau": 1.3, "drift_jsd": 0.4,
                "train_s": 70.0}]}
    for ph in cfg.phases:
        ps = _prompts(3, ph)
        before = shift.measure(arms, ps, cfg, None)
        after = shift.measure(arms, ps, cfg, before.pop("reference"))
        rep["phases"].append({"phase": ph, "title": ph, "before": before["by_concurrency"],
                              "after": after["by_concurrency"]})
    rep["contrast"] = {"_cost_model": {"target_ms": [50.0, 60.0, 65.0, 70.0], "draft_ms": 10.0,
                                       "step_ms": [50.0, 70.0, 85.0, 100.0], "breakeven_tau": [1.0, 1.4, 1.7, 2.0]},
                       "open-ended": {"structured": False, "num_prompts": 3, "k_chosen": 0, "acceptance": [],
                                      "itl_ms_p50_none": 50.0, "itl_ms_p50_spec": 52.0, "tokens_per_s_none": 20.0,
                                      "tokens_per_s_spec": 19.0, "speedup": 0.95, "tau": 1.0, "mismatches": 0}}
    rep["summary"] = s = shift.summarize(rep)
    assert len(s["rows"]) == 4  # 2 phases × 2 concurrencies
    r = next(r for r in s["rows"] if r["phase"] == "code" and r["concurrency"] == 2)
    code_after = rep["phases"][1]["after"][2]
    assert r["adapted_over_static"] == pytest.approx(code_after["adapted"]["tokens_per_s"] /
                                                     code_after["static"]["tokens_per_s"])
    assert r["hybrid_over_none"] == pytest.approx(code_after["hybrid"]["tokens_per_s"] /
                                                  code_after["none"]["tokens_per_s"])
    assert s["goals"]["hybrid_over_none_min"] == pytest.approx(min(x["hybrid_over_none"] for x in s["rows"]))
    assert "hybrid never slower than no speculation" in s["goals"]["met"]
    g = s["goals"]
    assert g["cycle_s_max"] == 700.0 and g["cycles_promoted"] == 1 and g["lossless"] is True
    assert g["met"]["cycle ≤ 10 min"] is False  # 700 s
    assert g["met"]["open-ended never slower than no speculation"] is False  # 0.95×
    assert g["tau_code_adapted"] == pytest.approx(rep["phases"][1]["after"][1]["adapted"]["acceptance_length"])
    paths = shift.write_report(rep, tmp_path, "shift-test")
    for p in paths.values():
        assert p.stat().st_size > 5000  # a rendered PNG
    md = (tmp_path / "shift-test.md").read_text()
    assert "break-even τ k=1: 1.40, k=2: 1.70, k=3: 2.00" in md and g["breakeven_tau_k"] == 2.0
    assert "| code | 2 |" in md and "NOT met: cycle ≤ 10 min" in md and "![τ](shift-test-tau.png)" in md
    assert "hybrid/none" in md and "hybrid (champion + suffix corpus, goodput policy) / no speculation" in md
    back = json.loads((tmp_path / "shift-test.json").read_text())
    assert back["summary"]["goals"]["cycle_s_max"] == 700.0


def test_bench_params_and_the_phase_threshold():
    cfg = shift.ShiftConfig(traffic_prompts=10, traffic_max_new_tokens=80, train_epochs=2, concurrency=(1, 16))
    traffic = [{"input_ids": [1] * n} for n in (20, 120, 301)]  # KO/JA prompts tokenise longer
    assert shift.phase_threshold(traffic, cfg) == (20 + 120 + 301 + 3 * 80) // 2
    p = shift.bench_params(Params(), cfg)
    assert p.capture.seal_max_age_s is None and p.capture.seal_min_tokens == Params().capture.seal_min_tokens
    assert p.train.epochs == 2 and p.engine.max_batch == 16
    assert p.evaluate.max_new_tokens == 48 and p.curate.max_holdout == 12
    with pytest.raises(ValueError, match="unknown phase"):
        shift.phase_prompts("poetry", Params())


def test_measure_restarts_each_concurrency_from_the_deployed_suffix_tree(arms_hybrid):
    """The same held-out prompts run at every concurrency: a global suffix tree that kept the outputs
    of the level before would replay them (τ 6.9 on code at concurrency 8 in a quick run)."""
    eng = arms_hybrid["hybrid"][0]
    eng.set_suffix_corpus([[5, 6, 7]])
    seen = []
    orig = eng.set_suffix_corpus

    def spy(seqs):
        seen.append([list(x) for x in seqs])
        return orig(seqs)
    eng.set_suffix_corpus = spy
    try:
        shift.measure(arms_hybrid, _prompts(3, "code"), shift.ShiftConfig(concurrency=(1, 2), max_new_tokens=6), None)
    finally:
        del eng.set_suffix_corpus
    assert seen == [[[5, 6, 7]], [[5, 6, 7]]]  # both levels start from the deployed tree
    assert eng.suffix.retained_tokens > 3  # and the run itself still adds its outputs


def test_phases_option_picks_and_names_the_run():
    q = shift.ShiftConfig.quick()
    cfg = q.with_phases(["chat", "code", "math-en"])
    assert cfg.phases == ("chat", "code", "math-en") and cfg.name == "shift-quick-chat-code-math-en"
    assert cfg.concurrency == q.concurrency and q.with_phases(["chat", "code"]) is q
    for bad in (["code", "maths"], [], ["code", "code"]):
        with pytest.raises(ValueError, match="--phases"):
            q.with_phases(bad)
