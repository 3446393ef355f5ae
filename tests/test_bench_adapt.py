"""bench adapt (self-improvement over many cycles): its schedule, sizes, seal threshold, and the summary
against the bench's goals, report and plots from a run's records. The run itself (`tidespec bench adapt`)
needs SmolLM2 and 15–120 min; its serving, cycle and measurement pieces are bench shift's (test_bench_shift)."""
from dataclasses import asdict

import pytest

from tidespec.bench import adapt, adapt_report
from tidespec.config import EngineParams


def test_schedule_validation_and_seal_threshold():
    cfg = adapt.AdaptConfig(cycles=3, switch_cycles=1, back_cycles=2)
    assert cfg.schedule() == ["code"] * 3 + ["chat"] + ["code"] * 2
    assert adapt.AdaptConfig(switch_to="").schedule() == ["code"] * 6
    for bad in ({"workload": "poetry"}, {"switch_to": "code"}, {"eval_prompts": 4}):  # eval < concurrency 8
        with pytest.raises(ValueError):
            adapt.AdaptConfig(**bad).validate()
    chunk = [{"input_ids": [1] * 40}, {"input_ids": [1] * 60}]
    assert adapt.seal_tokens([chunk, chunk], 50) == int(0.6 * (40 + 60 + 2 * 50))
    q = adapt.AdaptConfig.quick()
    assert q.cycles == 3 and q.as_shift().concurrency == (1, 8) and q.validate() is q


def test_a_given_static_is_checked_and_named_in_the_command(tmp_path):
    """`--static DIR`: a dir without the draft's files is refused naming the field; the command that
    reproduces a run carries it."""
    with pytest.raises(ValueError, match="--static .*not a draft dir"):
        adapt.AdaptConfig(static=str(tmp_path)).validate()
    for f in ("config.json", "model.safetensors"):
        (tmp_path / f).write_text("{}")
    cfg = adapt.AdaptConfig.quick()
    cfg = type(cfg)(**(asdict(cfg) | {"static": str(tmp_path)})).validate()
    assert adapt.command(asdict(cfg)) == f"tidespec bench adapt --quick --static {tmp_path}"


def _point(cycle, workload, tau, tps_default, tps_static=10.0, mism=0):
    def arm(t, tps):
        return {"acceptance_length": t, "tokens_per_s": tps, "mismatches": mism, "accepted_per_pos/0": t - 1,
                "accepted_per_pos/1": (t - 1) / 2}
    by = {c: {"none": arm(1.0, 9.0), "static": arm(1.2, tps_static), "in_domain": arm(1.5, tps_static * 1.25),
              "adapted": arm(tau, tps_default * 0.8), "default": arm(tau + 0.2, tps_default)} for c in (1, 8)}
    return {"cycle": cycle, "workload": workload, "served_s": 60.0 * cycle, "captured_tokens": 1000 * cycle,
            "champion_version": str(cycle + 1), "by_concurrency": by}


def _report(taus, back_tau, promoted_worse_at=None):
    cfg = adapt.AdaptConfig(cycles=len(taus) - 1, concurrency=(1, 8))
    pts = [_point(i, "code", t, 10.0 + 5 * i) for i, t in enumerate(taus)]
    pts += [_point(0, "chat", 1.1, 9.0), _point(len(taus), "code", taus[-1] - 0.3, 12.0),
            _point(len(taus), "chat", 1.3, 10.0), _point(len(taus) + 1, "code", back_tau, 30.0)]
    cycles = [{"cycle": i, "workload": "code", "promoted": True, "snapshot_tokens": 900, "cycle_s": 100.0,
               "reason": "τ ok"} for i in range(1, len(taus))]
    cycles += [{"cycle": len(taus), "workload": "chat", "promoted": False, "snapshot_tokens": 900, "cycle_s": 90.0,
                "reason": "τ <"}]
    if promoted_worse_at:
        pts[promoted_worse_at]["by_concurrency"][1]["adapted"]["acceptance_length"] = 1.0
    from dataclasses import asdict
    return {"config": asdict(cfg), "k": 4, "cpu_threads": 2, "points": pts, "cycles": cycles, "wall_s": 3600.0}


def test_summary_states_each_goal_from_the_records():
    rep = _report([1.2, 1.6, 1.9, 2.1], back_tau=2.05)
    s = adapt_report.summarize(rep)
    assert s["tau_by_cycle"]["3"] == 2.1 and s["tau_still_rising"] is True
    assert s["default_over_static"] == {"1": pytest.approx(25 / 10), "8": pytest.approx(25 / 10)}
    assert s["switch_default_over_static"] == {"1": pytest.approx(1.0), "8": pytest.approx(1.0)}  # chat: 10 / 10
    assert s["after_back_within_5pct"] is True and s["tau_after_back"] == 2.05 and s["promoted_worse"] == []
    flat = adapt_report.summarize(_report([1.2, 1.8, 1.9, 1.9], back_tau=1.7))
    assert flat["tau_still_rising"] is False and flat["after_back_within_5pct"] is False  # 1.7 < 0.95 × 1.9
    worse = adapt_report.summarize(_report([1.2, 1.6, 1.9, 2.1], back_tau=2.0, promoted_worse_at=2))
    assert worse["promoted_worse"] == [2]  # promoted, and held-out τ fell 1.6 → 1.0
    assert worse["promoted_worse_beyond_noise"] == [2]  # no num_drafts recorded: SE 0, any drop counts
    small = _report([1.2, 1.6, 2.0, 1.9], back_tau=2.0)  # cycle 3 promoted, τ 2.0 → 1.9 (−5 %)
    for p in small["points"]:
        p["by_concurrency"][1]["adapted"]["num_drafts"] = 20  # 20 verify steps: SE ≈ 0.11 and 0.15
    s2 = adapt_report.summarize(small)
    assert s2["promoted_worse"] == [3] and s2["promoted_worse_beyond_noise"] == []  # 0.1 < 2 × 0.18
    assert s2["tau_se_by_cycle"]["2"] == pytest.approx((0.25 / 20) ** 0.5)  # per_pos [1.0, 0.5]: Var X = 0.25


def test_report_markdown_and_plots(tmp_path):
    rep = _report([1.2, 1.6, 1.9, 2.1], back_tau=2.05)
    rep["summary"] = adapt_report.summarize(rep)
    rep["command"] = adapt.command(rep["config"])
    paths = adapt_report.write_report(rep, tmp_path, "adapt-test")
    assert sorted(paths) == ["per_position", "ratio", "tau", "tokens_per_s"]
    assert all(p.stat().st_size > 5000 for p in paths.values())  # real PNGs, not empty canvases
    md = (tmp_path / "adapt-test.md").read_text()
    assert "Command: `tidespec bench adapt --cycles 3`" in md  # the fields that differ from the defaults
    assert adapt.command(dict(asdict(adapt.AdaptConfig.quick()), switch_to="", passes=3)) == \
        "tidespec bench adapt --quick --switch-to '' --passes 3"
    assert (
        "c=1 2.50× (2.50–2.50)" in md
        and "on chat after its cycle: c=1 1.00×" in md
        and "still rising at cycle 3: True" in md
        and "(within 5 %: True)" in md
        and "in-domain static tokens/s after cycle 3 (paired median, range): c=1 2.00× (2.00–2.00)" in md
        and "| v4 | " in md and "| 1.20 / 1.50 / 2.10 / 2.30 |" in md  # τ static / in-domain / adapted / default
    )


def test_point_measures_several_passes_and_pairs_their_ratios(tiny_target):
    """A point runs `passes` side-by-side measurements on fresh engines: tokens/s is the median, the
    per-pass values are kept for paired ratios, τ and outputs are those of a greedy run (lossless)."""
    import torch

    from conftest import random_draft
    from tidespec.engine.speculative import Engine
    from tidespec.models.runner import DraftRunner

    def arms():
        return {
            "none": (Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256, max_batch=4)), False),
            "default": (
                Engine(
                    tiny_target,
                    DraftRunner(random_draft(tiny_target, seed=4)),
                    EngineParams(num_draft_tokens=3, max_seq_len=256, max_batch=4),
                ),
                True,
            ),
        }

    g = torch.Generator().manual_seed(0)
    hold = [{"id": f"p{i}", "input_ids": torch.randint(3, 300, (6 + i,), generator=g).tolist(), "workload": "code"}
            for i in range(4)]
    cfg = adapt.AdaptConfig(concurrency=(1, 4), eval_prompts=4, max_new_tokens=8, passes=3)
    by_c, ref = adapt.point(arms, hold, cfg, None)
    assert sorted(ref) == ["p0", "p1", "p2", "p3"]
    for c in (1, 4):
        d = by_c[c]["default"]
        assert len(d["tokens_per_s_passes"]) == 3 and d["tokens_per_s"] == sorted(d["tokens_per_s_passes"])[1]
        assert d["mismatches"] == 0 and by_c[c]["none"]["acceptance_length"] == 1.0
    med, lo, hi = adapt_report.ratio_spread(by_c, "default", "none")[1]
    assert lo <= med <= hi and lo > 0


def test_ratio_spread_pairs_passes():
    by_c = {1: {"a": {"tokens_per_s": 2.0, "tokens_per_s_passes": [2.0, 4.0, 3.0]},
                "b": {"tokens_per_s": 2.0, "tokens_per_s_passes": [1.0, 2.0, 3.0]}}}
    assert adapt_report.ratio_spread(by_c, "a", "b") == {1: (2.0, 1.0, 2.0)}  # ratios 2, 2, 1: paired per pass
