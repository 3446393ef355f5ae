"""Static draft bootstrap: the "draft pretrained on generic data" the adapted draft must beat.

Generic chat (ShareGPT first exchanges) is teacher-forced through the target in one prefill per
conversation: the inputs are the dataset's own answers, the training signal is the target's
distribution at every assistant position (its logits from the captured last hidden state). This is
the fast bootstrap (no generation on 2 cores); regenerated answers would match the target's own
outputs better. Records use the capture format, so the same trainer serves both.
"""
from __future__ import annotations

from typing import Callable

import torch

from .models.target import Target


def chat_ids(tok, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """Token ids of a chat through the target's chat template."""
    out = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                  return_dict=True)
    return list(out["input_ids"])


def prompt_ids(tok, text: str) -> list[int]:
    """Chat-formatted ids for one user message, ending with the assistant generation prompt."""
    return chat_ids(tok, [{"role": "user", "content": text}], True)


def teacher_force(target: Target, tok, conversations: list[list[dict]], max_tokens: int,
                  progress: Callable[[int], None] | None = None,
                  token_budget: int | None = None) -> list[dict[str, torch.Tensor]]:
    """Capture-format records for the first user→assistant exchange of each conversation, until
    `token_budget` tokens (prompt + answer) are collected (None: every conversation).

    Returns dicts with input_ids `[T]` int32, loss_mask `[T]` uint8 (1 on the answer),
    aux_hidden_states `[T, 3H]` bf16, hidden_states `[T, H]` bf16; T ≤ max_tokens. Conversations
    whose prompt alone fills max_tokens are skipped. `progress(tokens)` after each conversation.
    """
    recs, total = [], 0
    for conv in conversations:
        if token_budget is not None and total >= token_budget:
            break
        if len(conv) < 2 or conv[0]["role"] != "user" or conv[1]["role"] != "assistant":
            continue
        p = chat_ids(tok, conv[:1], True)
        full = chat_ids(tok, conv[:2], False)[:max_tokens]
        if len(p) >= len(full) - 2:
            if progress:
                progress(0)
            continue
        ids = torch.tensor(full, dtype=torch.int64)
        cache = target.new_cache(len(full))
        out = target.forward(ids, cache)
        mask = torch.zeros(len(full), dtype=torch.uint8)
        mask[len(p):] = 1
        recs.append({"input_ids": ids.to(torch.int32), "loss_mask": mask,
                     "aux_hidden_states": out.aux.to(torch.bfloat16),
                     "hidden_states": out.hidden.to(torch.bfloat16)})
        total += len(full)
        if progress:
            progress(len(full))
    return recs
