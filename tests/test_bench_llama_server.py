"""`tidespec bench llama-server`'s arithmetic and refusals (the servers themselves: test_llama_cpp_real)."""
import pytest

from tidespec.bench import llama_server as ls

X = "llama_cpp_server_eagle3_static"


def _run(ps, row, wall, toks, drafts=None):
    return {"pass": ps, "c": 1, "workload": "code", "row": row, "wall_s": wall, "tokens": toks, "drafts": drafts}


def test_paired_ratio_tau_and_identical_share_per_pass():
    d = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 15, "num_accepted_tokens_per_pos": [8, 4]}
    runs = [_run(0, ls.NO_SPEC, 2.0, {"a": [1] * 10, "b": [2] * 10}),  # 10 tokens/s
            _run(0, X, 1.0, {"a": [1] * 10, "b": [2] * 10}, d),  # 20 tokens/s: 2.0x
            _run(1, ls.NO_SPEC, 1.0, {"a": [1] * 10, "b": [2] * 10}),  # 20 tokens/s
            _run(1, X, 4.0, {"a": [1] * 10, "b": [3] * 10}, d)]  # 5 tokens/s: 0.25x, b differs
    s = ls.summarize(runs)["1"]["code"]
    x = s[X]
    assert x["ratio"] == {"median": 1.125, "min": 0.25, "max": 2.0, "inside_noise": True}
    assert x["tokens_per_s"] == 12.5 and x["identical"] == x["as_llama_cpp"] == 0.75
    assert x["tau"] == pytest.approx(1 + 30 / 20)  # summed counters over both passes
    assert s[ls.NO_SPEC]["tau"] is None and s[ls.NO_SPEC]["ratio"]["median"] == 1.0
    md = ls.markdown({"date": "2026-12-06", "machine": {"cpu": "cpu", "cores": 2}, "command": "c",
                      "setup": {"threads": 2, "llama_cpp": "x", "k": 4, "prompts": 2, "prompt_source": "p",
                                "max_new_tokens": 8, "passes": 2}, "results": ls.summarize(runs)})
    assert f"| 1 | code | {X} | 12.5 | 1.125 (0.250–2.000) * | 2.50 | 0.75 | 0.75 |" in md
    assert f"| 1 | code | {ls.NO_SPEC} | 15.0 | reference | — | 1.00 | 1.00 |" in md


def test_a_tidespec_row_is_held_to_its_own_plain_decoding():
    same, other = {"a": [1, 2], "b": [3, 4]}, {"a": [1, 2], "b": [3, 5]}
    runs = [_run(0, ls.NO_SPEC, 1.0, other),  # llama.cpp's kernels round otherwise on b
            _run(0, "tidespec_serve_int4_no_spec", 1.0, same), _run(0, "tidespec_serve_int4_default", 0.5, same),
            _run(0, "tidespec_serve_fp32_no_spec", 1.0, same), _run(0, "tidespec_serve_fp32_default", 0.5, other)]
    s = ls.summarize(runs)["1"]["code"]
    assert s["tidespec_serve_int4_default"]["identical"] == 1.0  # equal to int4's plain decoding ...
    assert s["tidespec_serve_int4_default"]["as_llama_cpp"] == 0.5  # ... not to llama.cpp's
    assert s["tidespec_serve_fp32_default"]["identical"] == 0.5  # b differs from fp32's own plain: caught
    assert s["tidespec_serve_fp32_default"]["ratio"]["median"] == 2.0  # 8 tokens in 0.5 s vs 4 in 1 s


@pytest.mark.parametrize("args, msg", [
    (["--prompts", "4", "--concurrency", "1", "8"], "--prompts 4 < the highest --concurrency 8"),
    (["--passes", "0"], "must be >= 1"),
    (["--static", "/nonexistent"], "--static /nonexistent: no draft there"),
])
def test_refused_before_any_server_starts(args, msg):
    with pytest.raises(SystemExit, match=msg):
        ls.main(args)


def test_tidespec_rows_per_precision_plain_and_default(tmp_path):
    from tidespec.bench.tidespec_server import ServeRow
    from tidespec.config import load_params
    p = load_params("params.yaml")
    rows = ServeRow.rows(p, ["fp32", "int4", "fp32"], tmp_path / "champ")
    assert list(rows) == ["tidespec_serve_fp32_no_spec", "tidespec_serve_fp32_default",
                          "tidespec_serve_int4_no_spec", "tidespec_serve_int4_default"]
    plain, dflt = rows["tidespec_serve_int4_no_spec"], rows["tidespec_serve_int4_default"]
    assert plain.champion is None and not plain.params.engine.suffix.enabled  # nothing left to speculate with
    assert dflt.champion == tmp_path / "champ" and dflt.params.engine == p.engine  # params.yaml's own config
    assert (dflt.params.target.quantization, plain.params.target.quantization) == ("int4", "int4")
    assert rows["tidespec_serve_fp32_default"].params.target == p.target
    assert dflt.describe() == {"precision": "int4", "champion": str(tmp_path / "champ"),
                               "suffix": p.engine.suffix.enabled, "adaptive": p.engine.adaptive,
                               "num_draft_tokens": p.engine.num_draft_tokens}


def test_tidespec_rows_need_the_adapted_champion():
    with pytest.raises(SystemExit, match="--tidespec's default rows serve --adapted"):
        ls.main(["--tidespec", "fp32"])


def test_launch_leaves_out_the_unset_variables_and_runs_in_cwd(tmp_path, monkeypatch):
    """What keeps a bench's `tidespec serve` off the shell's registry (`tidespec_server.UNSET`)."""
    import json
    import sys

    from tidespec.adapters import process
    from tidespec.bench.tidespec_server import UNSET
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://registry.example")
    monkeypatch.setenv("TIDESPEC_KEEP_ME", "kept")
    code = ("import json, os; print(json.dumps([os.environ.get(k) for k in "
            "('MLFLOW_TRACKING_URI', 'TIDESPEC_KEEP_ME', 'OMP_NUM_THREADS')] + [os.getcwd()]))")
    log = tmp_path / "log"
    p = process.launch([sys.executable, "-c", code], log, env={"OMP_NUM_THREADS": "2"}, cwd=tmp_path, unset=UNSET)
    assert p.wait(60) == 0
    assert json.loads(log.read_text().splitlines()[-1]) == [None, "kept", "2", str(tmp_path)]
