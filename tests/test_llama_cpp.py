"""The llama.cpp adapter without a server: the launch line, the counters parsed from llama.cpp's own
exposition, the converted draft's cache key and the requests refused before llama.cpp sees them.
The build: tests/test_llama_cpp_build.py; the real server: tests/test_llama_cpp_real.py."""
from __future__ import annotations

import json

import pytest

from tidespec.backends import llama_cpp

# llama-server's /metrics after three EAGLE-3 requests at k = 4 (b11312, trimmed: other series and HELP lines)
EXPOSITION = """\
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 39
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 528
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 46
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 133
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 32
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 12
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 2
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="3"} 0
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
"""


def test_counters_parse_into_the_vllm_backends_type():
    c = llama_cpp.parse_metrics(EXPOSITION)
    assert c == llama_cpp.SpecDecodeCounters(133, 528, 46, (32, 12, 2, 0))
    assert c.acceptance_length == pytest.approx(1 + 46 / 133)
    assert c.per_position_rate[0] == pytest.approx(32 / 133)
    assert llama_cpp.parse_metrics("# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 0\n") \
        is None  # no counters exported: live τ unknown, never 0


def test_a_draft_speculates_only_with_spec_type_draft_eagle3(tmp_path):
    cfg = llama_cpp.LlamaCppLaunch("/t.gguf", draft_path="/d.gguf", num_speculative_tokens=5, port=9000, parallel=3,
                                   ctx_per_slot=1024, threads=2, home=str(tmp_path), alias="m")
    a = llama_cpp.launch_args(cfg)
    assert a[0] == str(tmp_path / "bin" / "llama-server")
    joined = " ".join(a)
    for part in ("-m /t.gguf", "-md /d.gguf", "--spec-type draft-eagle3", "--spec-draft-n-max 5", "-np 3",
                 "-c 3072", "--metrics", "-t 2", "--alias m", "--host 127.0.0.1 --port 9000"):
        assert part in joined
    plain = llama_cpp.launch_args(llama_cpp.LlamaCppLaunch("/t.gguf", port=9000, home=str(tmp_path)))
    assert "-md" not in plain and "--spec-type" not in plain
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        llama_cpp.LlamaCppLaunch("/t.gguf", num_speculative_tokens=0)


def test_the_converted_draft_is_keyed_by_its_content(tmp_path):
    draft, target = tmp_path / "b" / "draft", tmp_path / "t"
    draft.mkdir(parents=True)
    target.mkdir()
    (draft / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}))
    (draft / "model.safetensors").write_bytes(b"w")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (target / f).write_text("{}")
    key = llama_cpp.draft_key(tmp_path / "b", target)
    assert key == llama_cpp.draft_key(draft, target) and len(key) == 20  # a bundle or its draft/
    assert llama_cpp.draft_key(draft, target, "f16") != key
    (draft / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [27, 15, 2]}))
    assert llama_cpp.draft_key(draft, target) != key
    (target / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        llama_cpp.draft_key(draft, target)
