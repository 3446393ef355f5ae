"""The target's whole context: `engine.max_seq_len` unset serves up to max_position_embeddings, KV
caches grow with each request (`KVCache.reserve`), and a long prompt is prefilled in chunks
(`Target.forward_batch`, `PREFILL_CHUNK` rows at a time) so its attention scores stay
`[heads, chunk, context]`. The CLI test drives `tidespec serve` with a 6,000-token prompt."""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import torch
import yaml

from conftest import health, make_tiny_target, random_draft, tiny_params_yaml, wait_until

CONTEXT = 8192  # SmolLM2's max_position_embeddings, the default target's context


@pytest.fixture(scope="module")
def long_target_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("long-target"), max_position_embeddings=CONTEXT)


@pytest.fixture(scope="module")
def long_target(long_target_dir):
    from tidespec.models.target import load_target
    return load_target(long_target_dir)[0]


def test_chunked_prefill_matches_one_pass(long_target):
    """A 2,500-row prefill in chunks of 1,024 (3 forwards) against one pass. Each chunk's rows see
    the same keys in the same order; only the shape of the score GEMM differs, so rows may differ by
    fp32 rounding alone: |Δ| ≤ 64 ulp of the largest logit (8 layers, each a few rounded sums; 64 is
    2^6, far under the first wrong bit an indexing bug gives — a mutant that shifts a chunk's
    positions by one moves logits by O(1)). The aux and hidden rows are concatenated in order."""
    from tidespec.models.target import Segment
    ids = torch.randint(3, 320, (2500,), generator=torch.Generator().manual_seed(0))
    one = long_target.forward_batch([Segment(ids, long_target.new_cache(CONTEXT))], chunk=4096)[0]
    c = long_target.new_cache(CONTEXT)
    chunked = long_target.forward_batch([Segment(ids, c)], chunk=1024)[0]
    assert c.length == 2500 and chunked.logits.shape == one.logits.shape == (2500, 320)
    assert chunked.aux.shape == one.aux.shape and chunked.hidden.shape == one.hidden.shape
    ulp = torch.finfo(torch.float32).eps * float(one.logits.abs().max())
    assert float((chunked.logits - one.logits).abs().max()) <= 64 * ulp
    assert float((chunked.hidden - one.hidden).abs().max()) <= 64 * torch.finfo(torch.float32).eps * float(
        one.hidden.abs().max())
    assert torch.equal(chunked.logits.argmax(-1), one.logits.argmax(-1))


def test_kv_memory_grows_with_the_request_not_the_context(long_target):
    """With the whole 8,192-token context allowed (max_seq_len unset), a 40-token sequence holds
    64 cache rows (the smallest growth step), not 8,192; a 3,000-token prompt, prefilled in chunks of
    1,024, doubles its cache to 4,096 (amortised copies), capped at the context. The draft's cache alike."""
    from tidespec.config import EngineParams
    from tidespec.engine.speculative import Engine
    from tidespec.models.runner import DraftRunner
    runner = DraftRunner(random_draft(long_target, 64))
    assert Engine(long_target, runner, EngineParams(num_draft_tokens=3)).cfg.max_seq_len == CONTEXT
    with pytest.raises(ValueError, match="exceeds the target's context 8192"):
        Engine(long_target, None, EngineParams(max_seq_len=CONTEXT + 1))
    short, long = long_target.new_cache(CONTEXT), long_target.new_cache(CONTEXT)
    long_target.forward(torch.arange(3, 43), short)
    assert (short.length, short.capacity) == (40, 64)
    long_target.forward(torch.randint(3, 320, (3000,)), long)  # chunks of 1,024: 1,024 → 2,048 → 4,096 rows
    assert long.capacity == 4096
    long_target.forward(torch.tensor([5]), long)
    assert (long.length, long.capacity) == (3001, 4096)
    long_target.forward(torch.randint(3, 320, (3000,)), long)
    assert (long.length, long.capacity) == (6001, CONTEXT)
    with pytest.raises(ValueError, match="exceeds the cache"):
        long_target.forward(torch.randint(3, 320, (CONTEXT - 6000,)), long)
    dc = runner.new_cache(CONTEXT)
    runner.extend_batch([(torch.randn(40, 3 * long_target.cfg.hidden_size), torch.arange(3, 43), dc)])
    assert (dc.length, dc.k.shape[1]) == (40, 64)


def test_tidespec_serve_answers_a_6000_token_prompt(tmp_path, long_target_dir, long_target):
    """`tidespec serve` on the shipped engine settings (max_seq_len unset): a 6,000-token prompt is
    answered, losslessly (the tokens of the target alone), and /v1/models reports the context."""
    from tidespec.adapters.services import free_port
    from tidespec.config import EngineParams
    from tidespec.engine.sampling import SamplingParams
    from tidespec.engine.speculative import Engine
    raw = yaml.safe_load(tiny_params_yaml(long_target_dir))
    raw["engine"].pop("max_seq_len")
    raw["engine"]["adaptive"] = False  # fixed k: no calibration at start
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tidespec.cli", "serve", "--root", str(tmp_path), "--params",
                                 str(tmp_path / "params.yaml"), "--port", str(port), "--no-capture"],
                                cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: health(url), 180, "/health", proc)
            assert httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["max_model_len"] == CONTEXT
            prompt = torch.randint(3, 320, (6000,), generator=torch.Generator().manual_seed(1)).tolist()
            r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 8, "ignore_eos": True},
                           timeout=300)
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["usage"] == {"prompt_tokens": 6000, "completion_tokens": 8, "total_tokens": 6008}
        finally:
            proc.terminate()
            proc.wait(60)
    want = Engine(long_target, None, EngineParams(num_draft_tokens=3)).generate(
        prompt, 8, speculative=False, sampling=SamplingParams(ignore_eos=True)).tokens
    assert body["tidespec"]["token_ids"] == want  # served speculatively == the target alone
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def test_synthetic_target_runs_at_its_width():
    """The scale benches' synthetic target: the widths asked for, a forward with aux `[n, 3H]`, and
    a teacher-logit row over the whole vocab (small widths here; the named ones take GBs)."""
    from tidespec.bench.synthetic import named, synthetic_target
    t = synthetic_target(256, 4, 8, 2, 512, 1000)
    assert (t.cfg.hidden_size, t.cfg.num_layers, t.aux_layers, t.cfg.head_dim) == (256, 4, (0, 2, 3), 32)
    out = t.forward(torch.arange(3, 40), t.new_cache(64))
    assert out.aux.shape == (37, 768) and out.logits.shape == (37, 1000) and torch.isfinite(out.logits).all()
    with pytest.raises(KeyError, match="one of smollm2, h2048, llama8b-width"):
        named("h9999")


def test_scaling_bench_counts_the_bytes_a_record_holds():
    """`bench scaling`'s bytes per token at rest: a raw record is aux `[T, 3H]` + hidden `[T, H]` in
    bf16 (8·H bytes per token) + ids (int32) + loss mask (uint8), plus one safetensors header
    (under 1 KiB, shared by the T tokens); zstd stores fewer."""
    from tidespec.bench.scaling import _round
    from tidespec.bench.synthetic import synthetic_target
    t = synthetic_target(128, 4, 4, 2, 256, 500)
    r = _round(t, list(range(3, 259)))
    assert 8 * 128 + 5 <= r["raw_bytes_per_token"] <= 8 * 128 + 5 + 1024 / 256
    assert r["zstd_bytes_per_token"] < r["raw_bytes_per_token"] and r["prefill_ms_per_token"] > 0
