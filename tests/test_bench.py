"""Benchmark bookkeeping (pure functions) and the cached start-up calibration."""
import json
from pathlib import Path

import pytest

from conftest import random_draft
from tidespec.bench.engine import summarize
from tidespec.bench.engine_report import markdown, ratios
from tidespec.engine.calibration import load_or_calibrate
from tidespec.models.runner import DraftRunner


def _r(pid, tokens, ttft, steps, drafts=None):
    return {"id": pid, "tokens": tokens, "ttft_s": ttft, "steps": steps, "forwards": 1 + len(steps), "drafts": drafts}


def test_summarize_counts_tokens_tau_itl_and_matches():
    ref = {"a": [1, 2, 3, 4], "b": [5, 6]}
    rows = [
        _r(
            "a",
            [1, 2, 3, 4],
            0.5,
            [(0.2, 2), (0.1, 1)],
            {
                "num_drafts": 2,
                "num_draft_tokens": 8,
                "num_accepted_tokens": 1,
                "num_accepted_tokens_per_pos": [1, 0, 0, 0],
            },
        ),
        _r(
            "b",
            [5, 7],
            0.5,
            [(0.1, 1)],
            {
                "num_drafts": 0,
                "num_draft_tokens": 0,
                "num_accepted_tokens": 0,
                "num_accepted_tokens_per_pos": [0, 0, 0, 0],
            },
        ),
    ]
    s = summarize(rows, ref)
    assert s["tokens"] == 6 and s["wall_s"] == pytest.approx(1.4)
    assert s["tokens_per_s"] == pytest.approx(6 / 1.4)
    assert s["tau"] == pytest.approx(6 / 5)  # 5 target forwards (2 prefills + 3 steps)
    assert s["itl_ms_p50"] == pytest.approx(100.0)  # samples 100, 100, 100, 100
    assert s["identical_to_target_only"] == 0.5
    assert s["acceptance_length"] == pytest.approx(1.5) and s["acceptance_rate"] == pytest.approx(1 / 8)
    assert s["accepted_per_pos"] == [0.5, 0, 0, 0]
    assert s["spec_steps_fraction"] == pytest.approx(2 / 3)


def test_ratios_and_markdown():
    def row(tps, itl):
        return {"tokens_per_s": tps, "itl_ms_p50": itl, "itl_ms_p99": itl, "tau": 1.0, "ttft_ms_p50": 1.0,
                "peak_rss_mb": 1.0, "identical_to_target_only": 1.0}
    rows = {
        "tidespec_no_spec": {"code": row(10, 100)},
        "tidespec_adapted_adaptive": {"code": row(15, 66)},
        "tidespec_adapted_k4": {"code": row(15, 66)},
        "tidespec_adapted_k4_capture": {"code": row(14.7, 67.32)},
        "hf_prompt_lookup_10": {"code": row(12, 80)},
        "hf_generate": {"code": row(8, 120)},
        "vllm_no_spec": {"code": row(8, 110)},
        "vllm_eagle3_adapted_k4": {"code": row(6, 150)},
    }
    r = ratios(rows, 4, 10)
    assert r["code: vllm_eagle3_adapted_k4 / vllm_no_spec"] == pytest.approx(0.75)  # vLLM rows against vLLM
    assert r["code: tidespec_no_spec / vllm_no_spec"] == pytest.approx(1.25)
    assert r["code: tidespec_adapted_adaptive / no_spec"] == pytest.approx(1.5)
    assert r["code: tidespec_adapted_adaptive / hf_prompt_lookup"] == pytest.approx(1.25)
    assert r["code: tidespec_no_spec / hf_generate"] == pytest.approx(1.25)
    assert r["code: capture ITL p50 overhead % (tidespec_adapted_k4)"] == pytest.approx(2.0)
    assert r["code: capture tokens/s overhead % (tidespec_adapted_k4)"] == pytest.approx(2.0)
    md = markdown({"date": "d", "machine": {"cpu": "c", "cores": 2, "threads": 2, "torch": "t"},
                   "setup": {"dtype": "float32", "prompts_per_workload": 1, "max_new_tokens": 8, "k": 4,
                             "prompt_lookup_num_tokens": 10}, "results": rows, "ratios": r, "info": {},
                   "methods": [{"kind": "vllm"}]})
    assert "| tidespec_adapted_adaptive | 15.00 |" in md and "code: tidespec_adapted_adaptive / no_spec: 1.500" in md
    assert "vllm_* rows: a vLLM" in md and "| vllm_eagle3_adapted_k4 | 6.00 |" in md

    adaptive = {"code": {"k": 2, "speculation": True, "predicted_speedup": 1.3, "conditional_acceptance": [0.7]}}
    realized = {"code": {8: {"plain": 0.98, "speculative": None, "margin": 0.05}},
                "math": {8: {"plain": 1.0, "speculative": 0.9, "margin": 0.1667}}}
    md = markdown({"date": "d", "machine": {"cpu": "c", "cores": 2, "threads": 2, "torch": "t"},
                   "setup": {"dtype": "float32", "prompts_per_workload": 1, "max_new_tokens": 8, "k": 4,
                             "prompt_lookup_num_tokens": 10}, "results": rows, "ratios": r, "methods": [],
                   "info": {"hybrid": {"adaptive": adaptive, "realized": realized,
                                       "calibration_ms": {"target": [30.0], "draft_step": 2.0}}}})
    # per class; a kind of step not seen at a batch size reads "–" (it crashed the report)
    assert "- hybrid / code: realized ÷ predicted tokens/ms (plain, speculative) and the margin a plan must clear, " \
           "by batch size: 8: 0.98, – → 5 %" in md
    assert "- hybrid / math: realized" in md and "8: 1.00, 0.90 → 17 %" in md

def test_calibration_is_measured_once_and_cached(tiny_target, tmp_path):
    runner = DraftRunner(random_draft(tiny_target, 64))
    cal = load_or_calibrate(tiny_target, runner, 3, tmp_path)
    assert len(cal.target_ms) == 4 and all(t > 0 for t in cal.target_ms) and cal.draft_ms > 0
    assert list(cal.target_ms) == sorted(cal.target_ms)  # a longer verify is never predicted cheaper
    (f,) = (tmp_path / "calibration").glob("*.json")
    d = json.loads(f.read_text())
    d["draft_ms"] = 123.0  # the cached file is what is used next time
    f.write_text(json.dumps(d))
    assert load_or_calibrate(tiny_target, runner, 3, tmp_path).draft_ms == 123.0
    assert load_or_calibrate(tiny_target, runner, 2, tmp_path).key != cal.key  # another k_max: measured anew
    f.write_text("{not json")  # a corrupt cache file is measured again, not an error
    assert load_or_calibrate(tiny_target, runner, 3, tmp_path).draft_ms != 123.0


def test_calibration_repeats_only_within_its_budget(tiny_target):
    """A spent budget leaves one pass over the target grid (plus the draft's two runs per batch size):
    a first `tidespec serve` on a loaded machine calibrates in bounded time, and says what it does."""
    from tidespec.engine.calibration import calibrate
    runner = DraftRunner(random_draft(tiny_target, 64))
    said = []
    calibrate(tiny_target, runner, 3, context=16, reps=5, max_batch=2, budget_s=0.0, progress=said.append)
    assert [m.split(" ")[0] for m in said] == ["timing", "timing"]  # pass 1, the draft; no "pass 2"
    said.clear()
    calibrate(tiny_target, runner, 3, context=16, reps=5, max_batch=2, budget_s=1e9, progress=said.append)
    assert sum(m.startswith("pass ") for m in said) == 5  # an ample budget: every repeat runs


def test_bench_engine_without_drafts_says_what_to_do(tmp_path):
    """Refused before any model is fetched or loaded, naming the fix."""
    from pathlib import Path

    from tidespec.bench.cli import bench_engine
    params = Path(__file__).resolve().parents[1] / "params.yaml"
    kw = dict(root=tmp_path, params=params, static=None, adapted=None, prompts=1, max_new_tokens=1, threads=1,
              prompt_lookup=10, out=tmp_path / "out", prompts_file=None)
    with pytest.raises(ValueError, match="make demo"):
        bench_engine(**kw, workload=["code", "math"], concurrency=[1, 4])
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"prompt": "Hi", "workload": "chat"}\n')
    with pytest.raises(ValueError, match=r"holds workloads \['chat'\], none of --workload's"):
        bench_engine(**(kw | {"prompts_file": mine}), workload=["code", "math"], concurrency=[1])
    with pytest.raises(ValueError, match="unknown workload"):
        bench_engine(**kw, workload=["poetry"], concurrency=[1])
    with pytest.raises(ValueError, match="--concurrency must be >= 1"):
        bench_engine(**kw, workload=["code"], concurrency=[0, 4])


def test_bench_train_on_tiny_target(tmp_path, tiny_target_dir):
    """`bench train` end to end on the tiny target: snapshot, curate, train with a learning curve, replay τ."""
    import json as _json

    import torch as _torch

    from conftest import tiny_params_yaml
    from tidespec.bench import train as bt
    from tidespec.config import load_params
    from tidespec.models.load import get_target
    (tmp_path / "params.yaml").write_text(tiny_params_yaml(tiny_target_dir))
    p = load_params(tmp_path / "params.yaml")
    target = get_target(p)[0]
    g = _torch.Generator().manual_seed(0)
    prompts = [(f"p{i}", _torch.randint(3, 320, (6,), generator=g).tolist()) for i in range(10)]
    shift = [(f"m{i}", _torch.randint(3, 60, (5,), generator=g).tolist()) for i in range(8)]
    rep = bt.run(p, tmp_path / "out", tmp_path / "root", target, prompts[:7], prompts[7:], max_new_tokens=12,
                 fractions=(0.5, 1.0), progress=lambda s: None, shift=("math", shift[:6], shift[6:]))
    assert [r["train_records"] for r in rep["runs"]] == [4, 7]  # 7 requests, half rounded
    for r in rep["runs"]:
        e = r["evaluate"]
        assert e["mismatches"] == 0 and e["new_tokens"] == 3 * 12  # greedy replay == target-only outputs
        assert 1.0 <= e["acceptance_length"] <= p.engine.num_draft_tokens + 1
        assert len(r["curve"]) == p.train.epochs and len(r["curve"][0]["holdout_acc"]) == p.train.ttt_steps
        assert r["cycle_seconds"]["total"] >= r["cycle_seconds"]["train"] > 0
    assert rep["snapshot"]["train"]["records"] == 7 and rep["snapshot"]["holdout"]["records"] == 3
    assert _json.loads((tmp_path / "out" / "train.json").read_text())["runs"][1]["fraction"] == 1.0
    assert "τ at k=3" in (tmp_path / "out" / "train.md").read_text()
    f = rep["forgetting"]
    assert f["replay_0.0"]["num_replay"] == 0 and f["replay_0.25"]["num_replay"] == 2  # round(6 * .25 / .75)
    assert f["replay_0.25"]["train_records"] == 8 and f["snapshot"]["train"]["records"] == 6
    for key in ("replay_0.0", "replay_0.25"):
        assert 1.0 <= f[key]["code"]["simulated_tau"] <= 4.0 and len(f[key]["math"]["acc"]) == p.train.ttt_steps
    assert "Forgetting" in (tmp_path / "out" / "train.md").read_text()
    again = bt.build_snapshot(tmp_path / "root", target, prompts[:7], prompts[7:], 12)  # cached
    assert again == rep["snapshot"]


def test_worker_peak_rss_is_its_own_not_the_coordinators(tiny_target_dir):
    """`bench engine` peak RSS per method: a worker spawned after the coordinator grew by 1 GiB
    (in the real run: after it loaded the target) reports its own peak, far below the
    coordinator's. With `ru_maxrss` (kept across fork + exec on Linux) the worker reported at
    least the coordinator's RSS at spawn time."""
    import multiprocessing as mp

    import numpy as np
    import yaml

    from conftest import tiny_params_yaml
    from tidespec.bench.engine import _Worker
    from tidespec.bench.methods import MethodSpec, peak_rss_mb
    from tidespec.config import Params

    pdict = Params.model_validate(yaml.safe_load(tiny_params_yaml(tiny_target_dir))).model_dump(mode="json")
    big = np.ones(1 << 30, dtype=np.uint8)  # 1 GiB, every page touched: resident in this process
    parent = peak_rss_mb()
    assert parent >= 1024 + 100
    w = _Worker(mp.get_context("spawn"), MethodSpec("hf_generate", "hf"), pdict, 1, None)
    try:
        w.ready()
        out = w.call("run", [5, 6, 7, 8], 4, "code")
        assert len(out["tokens"]) == 4  # the worker really loaded the model and generated
        child = w.rss
    finally:
        w.stop()
    del big
    # the worker: a fresh interpreter with torch + transformers + the tiny model (a few hundred MB);
    # the coordinator: at least 1 GiB more than that. Old code: child >= parent
    assert 50 < child < parent - 600, (child, parent)


def test_pass_ratios_are_paired_per_pass_and_flag_the_noise():
    from tidespec.bench.engine import pass_ratios

    def r(p, toks, secs):
        return {"pass": p, "tokens": [0] * toks, "ttft_s": 0.0, "steps": [(secs, toks)]}
    raw = {"tidespec_no_spec": {"code": [r(0, 10, 1.0), r(1, 10, 2.0), r(2, 10, 1.0)]},  # pass 1 ran slow
           "fast": {"code": [r(0, 10, 0.5), r(1, 10, 1.0), r(2, 10, 0.4)]},
           "same": {"code": [r(0, 10, 1.1), r(1, 10, 1.8), r(2, 10, 1.0)]}}
    s = pass_ratios(raw, "tidespec_no_spec", 3)["code"]
    assert s["fast"]["per_pass"] == pytest.approx([2.0, 2.0, 2.5]) and s["fast"]["median"] == pytest.approx(2.0)
    assert not s["fast"]["inside_noise"] and s["same"]["inside_noise"]  # 0.91–1.11 spans 1.0
    assert "tidespec_no_spec" not in s  # the reference is not compared with itself


def test_concurrency_sweep_summary_markdown_and_png(tmp_path):
    """Per pass, tokens/s = tokens / the run's wall time; the ratio pairs each pass with the
    reference's same pass; identical is judged per prompt id; the PNG is written."""
    from tidespec.bench.engine import by_concurrency, sweep_summary
    from tidespec.bench.engine_report import sweep_markdown
    from tidespec.steps import plots

    def run(ps, wall, toks, steps=((0.1, 2),)):
        return {"pass": ps, "wall_s": wall, "results": [{"id": "a", "tokens": toks, "forwards": 2,
                                                          "steps": list(steps)}]}
    per = {"tidespec_no_spec": {"code": [run(0, 2.0, [1, 2, 3, 4]), run(1, 4.0, [1, 2, 3, 4])]},
           "tidespec_hybrid_adaptive": {"code": [run(0, 1.0, [1, 2, 3, 4]), run(1, 4.0, [1, 2, 3, 5])]}}
    s = sweep_summary(per, "tidespec_no_spec")
    h = s["tidespec_hybrid_adaptive"]["code"]
    assert h["per_pass_tokens_per_s"] == [4.0, 1.0] and h["ratio"]["per_pass"] == [2.0, 1.0]
    assert h["ratio"]["inside_noise"] and h["identical_to_target_only"] == 0.5 and h["tau"] == 2.0
    assert "ratio" not in s["tidespec_no_spec"]["code"]
    res = {"concurrency": {"4": s}, "spread": {"code": {"tidespec_hybrid_adaptive": dict(h["ratio"], median=1.9)}},
           "results": {"tidespec_no_spec": {"code": {"tokens_per_s": 10.0, "tau": 1.0}},
                       "tidespec_hybrid_adaptive": {"code": {"tokens_per_s": 19.0, "tau": 2.6}}}}
    md = "\n".join(sweep_markdown(res))
    assert "| tidespec_hybrid_adaptive | 1.90× (1.00–2.00) ~ | 1.50× (1.00–2.00) ~ |" in md
    assert "19.0 · 2.60" in md and "50% of requests" in md
    data = by_concurrency(res)
    assert data["code"]["tidespec_hybrid_adaptive"] == [(1, 19.0), (4, 2.5)]
    plots.tokens_per_s_by_concurrency(data).savefig(tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 1000


def test_precision_and_llama_cpp_rows_their_references_and_report():
    """Rows at another precision compare with target-only at that precision (lossless there) and with
    params' precision; llama.cpp rows with llama.cpp's plain decoding; the report says so, and pairs
    tokens/s with llama.cpp's per pass."""
    from tidespec.bench.engine import default_methods, reference_of
    from tidespec.bench.engine_report import markdown, ratios

    specs = default_methods(None, Path("champion"), 4, 10, precisions=("int4",), llama_cpp=True)
    by = {s.name: s for s in specs}
    assert {"tidespec_no_spec_int4", "tidespec_hybrid_adaptive_int4", "llama_cpp_no_spec",
            "llama_cpp_prompt_lookup_4"} <= set(by)
    assert by["tidespec_hybrid_adaptive_int4"].precision == "int4" and by["tidespec_hybrid_adaptive_int4"].suffix
    assert reference_of(by["tidespec_hybrid_adaptive_int4"]) == "tidespec_no_spec_int4"
    assert reference_of(by["llama_cpp_prompt_lookup_4"]) == "llama_cpp_no_spec"
    assert reference_of(by["tidespec_hybrid_adaptive"]) == "tidespec_no_spec"
    assert "tidespec_no_spec_int4" not in {s.name for s in default_methods(None, None, 4, 10)}

    def row(tps, same=1.0):
        return {"tokens_per_s": tps, "itl_ms_p50": 1.0, "itl_ms_p99": 1.0, "tau": 1.5, "ttft_ms_p50": 1.0,
                "peak_rss_mb": 1.0, "identical_to_target_only": 1.0, "identical_to_reference_precision": same}
    rows = {"tidespec_no_spec": {"code": row(20)}, "tidespec_no_spec_int4": {"code": row(60, 0.5)},
            "tidespec_hybrid_adaptive_int4": {"code": row(90, 0.5)}, "llama_cpp_no_spec": {"code": row(75, 0.25)}}
    r = ratios(rows, 4, 10)
    assert r["code: tidespec_hybrid_adaptive_int4 / llama_cpp_no_spec"] == pytest.approx(1.2)
    assert r["code: tidespec_no_spec_int4 / llama_cpp_no_spec"] == pytest.approx(0.8)
    spread = {"code": {"tidespec_hybrid_adaptive_int4": {"median": 1.2, "min": 1.1, "max": 1.3, "per_pass": [],
                                                         "inside_noise": False}}}
    md = markdown({"date": "d", "machine": {"cpu": "c", "cores": 2, "threads": 2, "torch": "t"},
                   "setup": {"dtype": "float32", "prompts_per_workload": 1, "max_new_tokens": 8, "k": 4,
                             "prompt_lookup_num_tokens": 10, "passes": 3}, "results": rows, "ratios": r,
                   "info": {"llama_cpp_no_spec": {"llama_cpp_python": "0.3.36"}},
                   "methods": [{"kind": "tidespec", "precision": "int4"}, {"kind": "llama_cpp"}],
                   "spread_vs_llama_cpp": spread})
    assert "| tidespec_no_spec_int4 | 60.00 | 1.50 | - | 1.0 | 1.0 | 1 | 1 | 100% | 50% |" in md
    assert "| llama_cpp_no_spec | 75.00 | - |" in md and "llama-cpp-python 0.3.36 on the shipped GGUF" in md
    assert "## Paired ratios to llama_cpp_no_spec" in md
    assert "| tidespec_hybrid_adaptive_int4 | 1.20× (1.10–1.30) |" in md
    md = markdown({"date": "d", "machine": {"cpu": "c", "cores": 2, "threads": 2, "torch": "t"},
                   "setup": {"dtype": "float32", "prompts_per_workload": 1, "max_new_tokens": 8, "k": 4,
                             "prompt_lookup_num_tokens": 10, "llama_cpp_skipped": "llama-cpp-python is not installed"},
                   "results": rows, "ratios": r, "info": {}, "methods": []})
    assert "No llama_cpp_* rows: llama-cpp-python is not installed." in md


def test_llama_cpp_row_decodes_the_shipped_gguf():
    """The llama.cpp row on the real GGUF: greedy, the token ids given, stops at max_new; its plain
    decoding is deterministic. Skipped, naming why, where llama-cpp-python is not installed."""
    from tidespec.bench.methods import LlamaCppMethod, MethodSpec, llama_cpp_unavailable
    from tidespec.config import Params
    from tidespec.models.chat import prompt_ids
    from tidespec.models.load import get_target

    why = llama_cpp_unavailable()
    if why:
        pytest.skip(why)
    p = Params()
    ids = prompt_ids(get_target(p)[1], "def add(a, b):")
    m = LlamaCppMethod(MethodSpec("llama_cpp_no_spec", "llama_cpp"), p, 2)
    a, b = m.run(ids, 12, "code"), m.run(ids, 12, "code")
    assert len(a["tokens"]) == 12 and a["tokens"] == b["tokens"] and len(a["steps"]) == 11
    assert a["drafts"] is None and a["ttft_s"] > 0
    with pytest.raises(ValueError, match="llama.cpp rows run the shipped GGUF"):
        LlamaCppMethod(MethodSpec("x", "llama_cpp"), Params.model_validate({"target": {"source": "/some/dir"}}), 2)


def test_bench_engine_rows_as_the_options_say():
    """--precision names params' own precision once (the reference rows), any other one as rows; --method
    keeps each row's reference; an unknown row names why llama.cpp rows are missing."""
    from tidespec.bench.engine import select_methods
    from tidespec.config import Params

    p = Params()
    names = {s.name for s in select_methods(p, None, Path("c"), 10, None, ["fp32", "int4"], None, [])}
    assert "tidespec_no_spec_int4" in names and "tidespec_no_spec_fp32" not in names and "llama_cpp_no_spec" in names
    b4 = Params.model_validate({"target": {"dtype": "bfloat16", "quantization": "int4"}})  # no PRECISIONS name
    names = {s.name for s in select_methods(b4, None, Path("c"), 10, None, ["fp32", "int4"], None, [])}
    assert {"tidespec_no_spec_fp32", "tidespec_no_spec_int4"} <= names
    got = [s.name for s in select_methods(p, None, Path("c"), 10, None, ["int4"], None,
                                          ["tidespec_hybrid_adaptive_int4", "llama_cpp_prompt_lookup_4"])]
    assert sorted(got) == sorted(["tidespec_no_spec", "tidespec_no_spec_int4", "tidespec_hybrid_adaptive_int4",
                                  "llama_cpp_no_spec", "llama_cpp_prompt_lookup_4"])
    with pytest.raises(ValueError, match="--precision int3: choose from fp32, bf16, int8, int4"):
        select_methods(p, None, None, 10, None, ["int3"], None, [])
    with pytest.raises(ValueError, match=r"unknown method\(s\) \['llama_cpp_no_spec'\] \(not installed\)"):
        select_methods(p, None, None, 10, None, [], "not installed", ["llama_cpp_no_spec"])
