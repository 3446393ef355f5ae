"""The static draft, the loop's first step: EAGLE3 trained on generic chat (ShareGPT first
exchanges), the "draft pretrained on generic data" every adapted draft must beat, and the first
champion of a new target.

By default each conversation is teacher-forced through the target in one prefill (`teacher_force`):
the inputs are the dataset's own answers, the training signal the target's distribution at every
assistant position; `bootstrap.answers: target` regenerates the answers with the target
(`train.distill`), which fits the target better and costs generation. Records use the capture
format, so the cycle's trainer trains it. Cached in the download cache, keyed by the params that
shape it (`static_draft_dir`).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from ..assets import prompts
from ..config import Params
from ..models.chat import chat_ids
from ..models.target import Target
from ..train.trainer import train_draft

# progress(task, done, total or None, info): what a long step is doing (the caller draws or logs it)
Progress = Callable[[str, float, float | None, str], None]


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
                     "aux_hidden_states": out.aux.to("cpu", torch.bfloat16),
                     "hidden_states": out.hidden.to("cpu", torch.bfloat16)})
        total += len(full)
        if progress:
            progress(len(full))
    return recs


def static_draft_dir(params: Params, target_id: str, cache: Path) -> Path:
    """Where the static draft for these params lives in the download cache (keyed by their hash; the
    target's precision is part of it, as the hidden states it is trained on come from the target at
    that precision)."""
    b = params.bootstrap  # answers: dataset (the default) keeps the key drafts were cached under before the knob
    boot = b.model_dump(exclude={"answers"}) if b.answers == "dataset" else b.model_dump()
    # kl: the key before `loss` existed; rejected_weight: never weighs teacher-forced records (no draft served them)
    train = params.train.model_dump(exclude={"rejected_weight"} | ({"loss"} if params.train.loss == "kl" else set()))
    parts = [target_id, boot, params.draft.model_dump(), train]
    t = params.target
    if (t.dtype, t.quantization) != ("float32", "none"):  # fp32 keeps the key drafts were cached under before
        parts.append([t.dtype, t.quantization])
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]
    return cache / "bootstrap" / f"static-{key}"


def bootstrap_static(params: Params, target: Target, tok, cache: Path, progress: Progress | None = None,
                     say: Callable[[str], None] = print) -> Path:
    """Train (or reuse, from `cache`) the static generic-chat draft as `params.bootstrap` says; returns
    its checkpoint dir. `progress`: told each task's tokens / optimizer steps as they go; `say`: one
    line when it is reused and when it is trained. Raises what the trainer raises."""
    out = static_draft_dir(params, target.target_id, cache)
    if (out / "model.safetensors").exists():
        say(f"static draft: reusing cached bootstrap {out}")
        return out
    report = progress or (lambda *_: None)
    b, done = params.bootstrap, {"n": 0}

    def count(task: str):
        def tick(n: int) -> None:
            done["n"] += n
            report(task, done["n"], b.tokens, "")
        return tick
    convs = prompts.sharegpt_conversations(limit=b.conversations * 2)[: b.conversations]
    if b.answers == "target":  # self-distilled: the target's own greedy answers (generation)
        from ..train.distill import self_distill
        recs = self_distill(target, tok, convs, b.max_tokens, b.tokens,
                            progress=count("bootstrap: the target answers ShareGPT prompts (tokens)"))
    else:
        recs = teacher_force(target, tok, convs, b.max_tokens, progress=count("bootstrap: teacher-force ShareGPT "
                                                                              "(tokens)"), token_budget=b.tokens)
    n_val = max(1, len(recs) // 10)
    tp = params.train.model_copy(update={"epochs": b.epochs, "warm_start": False, "rejected_weight": 0.0})
    m = train_draft(recs[n_val:], recs[:n_val], target, params.draft, tp, out.with_suffix(".tmp"),
                    progress=lambda step, total, loss: report("bootstrap: train the static EAGLE3 draft (steps)", step,
                                                              total, f"loss {loss:.3f}"))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(out.with_suffix(".tmp"), out)
    sim = m["simulated_acceptance_length"]
    say(f"static draft: {len(recs)} conversations, {sum(len(r['input_ids']) for r in recs)} tokens "
        f"({sum(int(r['loss_mask'].sum()) for r in recs)} answer), simulated τ "
        f"{'n/a (no validation records)' if sim is None else f'{sim:.2f}'}, trained in {m['train_seconds']:.0f} s")
    return out
