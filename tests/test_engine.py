"""Engine: the lean target forward matches transformers; speculative greedy == target-only greedy."""
import pytest
import torch

from tidespec.engine.speculative import Engine
from tidespec.engine.stats import SpecDecodingStats, simulated_acceptance_length
from conftest import random_draft
from tidespec.models.eagle3 import DraftRunner, load_checkpoint


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
    eng = Engine(tiny_target, _random_runner(tiny_target, 64), num_draft_tokens=k, max_seq_len=256)
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
    eng = Engine(tiny_target, _random_runner(tiny_target, 64), num_draft_tokens=3, max_seq_len=64)
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([], 8)
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.generate(list(range(3, 63)), 8)
    with pytest.raises(ValueError, match="k"):
        eng.generate([5, 6], 8, k=0)
    with pytest.raises(ValueError):
        Engine(tiny_target, None, num_draft_tokens=0)
    assert len(eng.generate([5, 6, 7], 8).tokens) >= 1


def test_draft_of_other_target_is_refused(tiny_target):
    eng = Engine(tiny_target, None, 3, 64)
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


# -- real target (SmolLM2-135M): run once in CI ----------------------------------------------------
PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n",
           "Explain what a hash table is in two sentences.",
           "List three prime numbers greater than 100 as JSON.",
           "from typing import List\n\ndef mean(xs: List[float]) -> float:\n"]


@pytest.mark.full_model
def test_lossless_on_real_target(real_target, tmp_path):
    """≥5 real prompts × 64 new tokens: speculative greedy == target-only greedy, token for token,
    with a randomly initialised draft and with a trained one (teacher-forced, few epochs)."""
    from tidespec.bootstrap import prompt_ids, teacher_force
    from tidespec.config import DraftParams, TrainParams
    from tidespec.prompts import sharegpt_conversations
    from tidespec.train.trainer import train_draft

    target, tok = real_target
    recs = teacher_force(target, tok, sharegpt_conversations(limit=24)[:16], 192)
    train_draft(recs[2:], recs[:2], target, DraftParams(draft_vocab_size=2048),
                TrainParams(epochs=2, ttt_steps=3), tmp_path / "trained")
    trained = DraftRunner(load_checkpoint(tmp_path / "trained", target.embed, target.target_id))
    eng = Engine(target, None, num_draft_tokens=4, max_seq_len=512)
    ref = {p: eng.generate(prompt_ids(tok, p), 64, speculative=False).tokens for p in PROMPTS}
    for name, runner in (("random", _random_runner(target, 4096)), ("trained", trained)):
        eng.set_draft(runner, name)
        total = SpecDecodingStats(4)
        for p in PROMPTS:
            g = eng.generate(prompt_ids(tok, p), 64)
            assert g.tokens == ref[p], (name, p)
            assert len(g.tokens) == 64 or g.finish_reason == "stop"
            total = total.merge(g.stats)
        if name == "trained":
            assert total.num_accepted_tokens > 0  # the accept path was exercised, not only rejections
