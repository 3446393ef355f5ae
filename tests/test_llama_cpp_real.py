"""A real llama.cpp `llama-server` (`make llama-server`) running a tidespec draft converted to an
EAGLE-3 GGUF (`backends.llama_cpp`).

Target: SmolLM2-135M-Instruct Q4_1 as shipped (the asset GGUF); draft: trained here with the repo's
trainer on the target's own greedy outputs of the served prompts, so acceptance is well above 0 and
the counters discriminate a right conversion from a wrong one. Skipped, with the reason printed,
only where llama-server is not built (`backends.llama_cpp.unavailable_reason`).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from tidespec.backends import llama_cpp
from tidespec.backends.llama_cpp.convert import draft_gguf

K, MAX_TOKENS = 4, 32
PROMPTS = ["def fibonacci(n):\n", "The three primary colours are", "import json\n\ndef load(path):\n",
           "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def built() -> None:
    reason = llama_cpp.unavailable_reason()
    if reason:
        pytest.skip(f"llama.cpp cannot run here: {reason}")


@pytest.fixture(scope="module")
def trained(built, real_target, tmp_path_factory) -> tuple[Path, Path]:
    """(the draft trained on the target's greedy outputs of PROMPTS, the cache its GGUFs go to)."""
    from tidespec.config import DraftParams, EngineParams, TrainParams
    from tidespec.engine.speculative import Engine, Request
    from tidespec.train.trainer import train_draft
    target, tok = real_target
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    gens = Engine(target, None, EngineParams(num_draft_tokens=K, max_seq_len=256, max_batch=4)).generate_batch(
        [Request(p, MAX_TOKENS + 16, speculative=False, capture=True) for p in ids])
    out = tmp_path_factory.mktemp("llama-draft") / "draft"
    train_draft([g.record for g in gens], [], target, DraftParams(draft_vocab_size=1024),
                TrainParams(epochs=30, ttt_steps=K, batch_tokens=1024, max_seq_len=128, lr=3e-3), out)
    (out / "train_metrics.json").unlink()
    return out, tmp_path_factory.mktemp("llama-cache")


def _serve(draft: Path | None, tmp: Path, name: str) -> tuple[list[str], llama_cpp.SpecDecodeCounters | None]:
    """Each PROMPT completed greedily by a llama-server with `draft` (None: plain decoding); the
    texts and the server's counters after them."""
    # one thread: on a shared 2-core machine a second, spinning one slowed decoding several times over
    cfg = llama_cpp.LlamaCppLaunch.from_params(_params(), draft_path=str(draft) if draft else None, parallel=2,
                                               ctx_per_slot=512, threads=1)
    with llama_cpp.LlamaCppServer(cfg, tmp / f"{name}.log") as srv:
        texts = []
        for p in PROMPTS:
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": p, "max_tokens": MAX_TOKENS,
                                                               "temperature": 0, "ignore_eos": True}, timeout=300)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        return texts, llama_cpp.scrape(srv.url)


def _params():
    from tidespec.config import Params
    return Params()


def test_eagle3_draft_is_lossless_and_a_wrong_conversion_collapses_acceptance(trained, tmp_path):
    from tidespec.models.load import target_dir
    draft, cache = trained
    hf = target_dir("smollm2")
    gguf = draft_gguf(draft, hf, cache=cache)
    assert draft_gguf(draft, hf, cache=cache) == gguf  # converted once per content
    plain, none = _serve(None, tmp_path, "plain")
    spec, counters = _serve(gguf, tmp_path, "eagle3")
    assert spec == plain  # greedy: the target's own tokens, drafted or not
    assert none is not None and none.num_drafts == 0
    tau = counters.acceptance_length
    assert counters.num_drafts > 0 and len(counters.accepted_per_pos) == K
    assert tau > 1.5, counters
    assert counters.per_position_rate[0] >= counters.per_position_rate[-1]

    swapped = tmp_path / "swapped"  # the three aux layers in another order: converts fine, drafts badly
    shutil.copytree(draft, swapped)
    cfg = json.loads((swapped / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"][::-1]
    (swapped / "config.json").write_text(json.dumps(cfg))
    bad, worse = _serve(draft_gguf(swapped, hf, cache=cache), tmp_path, "swapped")
    assert bad == plain
    assert worse.acceptance_length - 1 < 0.5 * (tau - 1), (worse, counters)
