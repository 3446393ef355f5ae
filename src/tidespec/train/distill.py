"""Self-distilled bootstrap records: the target's own greedy answers to generic prompts.

`bootstrap.answers: target` trains the static draft on what the target itself says after each
ShareGPT first user turn, instead of teacher-forcing the dataset's (ChatGPT-written) answers through
it (`steps.bootstrap.teacher_force`): the draft then learns the distribution it will be verified against,
the advice speculators' maintainers give (vllm-project/speculators #613; EAGLE-3 §4 regenerates its
training answers with the target). The cost is generation: answers are decoded greedily by the
embedded engine without speculation, `batch` at a time (≈ 60–90 tokens/s on 2 CPU cores for
SmolLM2-135M at batch 8, against a single prefill per conversation for teacher forcing).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..config import EngineParams
from ..engine.build import make_engine
from ..engine.speculative import Request
from ..models.chat import chat_ids
from ..models.target import Target


def self_distill(target: Target, tok, conversations: list[list[dict]], max_tokens: int, token_budget: int,
                 batch: int = 8, progress: Callable[[int], None] | None = None) -> list[dict[str, torch.Tensor]]:
    """Capture-format records of the target's greedy answer to each conversation's first user turn,
    until `token_budget` tokens (prompt + answer) are collected; each record at most `max_tokens`
    long (answers stop at EOS or there). Prompts that leave fewer than 16 tokens of room are skipped.

    Returns dicts with input_ids `[T]` int32, loss_mask `[T]` uint8 (1 on the answer),
    aux_hidden_states `[T, 3H]` bf16, hidden_states `[T, H]` bf16. `progress(tokens)` after each record.
    """
    eng = make_engine(EngineParams().fixed(max_seq_len=max(16, max_tokens + 1), max_batch=batch), target)
    prompts = [chat_ids(tok, conv[:1], True) for conv in conversations if conv and conv[0]["role"] == "user"]
    prompts = [p for p in prompts if len(p) <= max_tokens - 16]
    recs, total = [], 0
    for i in range(0, len(prompts), batch):
        if total >= token_budget:
            break
        reqs = [Request(p, max_tokens - len(p), speculative=False, capture=True) for p in prompts[i:i + batch]]
        for g in eng.generate_batch(reqs):
            r = g.record
            recs.append({"input_ids": r["input_ids"], "loss_mask": r["loss_mask"],
                         "aux_hidden_states": r["aux_hidden_states"].to(torch.bfloat16),
                         "hidden_states": r["hidden_states"].to(torch.bfloat16)})
            total += len(r["input_ids"])
            if progress:
                progress(len(r["input_ids"]))
    return recs
