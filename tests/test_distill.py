"""Self-distilled bootstrap (`bootstrap.answers: target`): records hold the target's own greedy
answers, in the capture format the trainer reads, up to the token budget."""
import shutil

import torch

from conftest import add_tiny_word_tokenizer
from tidespec.config import EngineParams
from tidespec.engine.speculative import Engine
from tidespec.models.chat import chat_ids
from tidespec.models.target import load_target
from tidespec.train.distill import self_distill


def test_records_are_the_targets_greedy_answers(tiny_target_dir, tmp_path):
    d = tmp_path / "t"
    shutil.copytree(tiny_target_dir, d)
    add_tiny_word_tokenizer(d)
    target, tok = load_target(d)
    convs = [[{"role": "user", "content": f"t{10 + i} t{20 + i} t{30 + i}"}, {"role": "assistant", "content": "x"}]
             for i in range(5)]
    recs = self_distill(target, tok, convs, max_tokens=32, token_budget=70, batch=2)
    assert len(recs) == 4  # batches of 2 until 70 tokens: 2 × 32 < 70 ≤ 4 × 32
    plain = Engine(target, None, EngineParams(num_draft_tokens=1, max_seq_len=64))
    for conv, r in zip(convs, recs):
        p = chat_ids(tok, conv[:1], True)
        gen = plain.generate(p, 32 - len(p)).tokens
        assert r["input_ids"].tolist() == p + gen[:-1]  # the target's own answer, not the dataset's "x"
        assert r["loss_mask"].tolist() == [0] * len(p) + [1] * (len(gen) - 1)
        T, H = len(r["input_ids"]), target.cfg.hidden_size
        assert r["aux_hidden_states"].shape == (T, 3 * H) and r["aux_hidden_states"].dtype == torch.bfloat16
        assert r["hidden_states"].shape == (T, H)
        out = target.forward(r["input_ids"].long(), target.new_cache(T))  # hidden states of that exact sequence
        assert torch.allclose(r["hidden_states"].float(), out.hidden.bfloat16().float())
