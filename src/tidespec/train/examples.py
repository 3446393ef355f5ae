"""Training examples from capture records: the target's next-token distribution at every position (from the
captured last hidden state through its lm_head), mapped into the draft vocabulary, and length-grouped, padded
batches of them."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.target import Target


@dataclass
class Example:
    """One training sequence: aux `[T, 3H]` as the record holds it (bf16 from a snapshot; cast to
    fp32 on the training device, `collate`), ids `[T]` int64, target logits over the draft
    vocab `[T, Vd]` bf16, valid `[T]` bool (learnable position: kept by the loss mask, and its
    target argmax is in the draft vocab), keep `[T]` bool (kept by the loss mask, whatever the
    argmax: the positions a draft is evaluated on; None = same as valid)."""

    aux: torch.Tensor
    ids: torch.Tensor
    tlogits: torch.Tensor
    valid: torch.Tensor
    keep: torch.Tensor | None = None


def prepare(records: list[dict], target: Target, t2d: torch.Tensor, max_len: int,
            loss_on_prompt: bool = False, dropped: Counter | None = None) -> list[Example]:
    """Turn capture records into examples (target logits computed once, restricted to the draft vocab).

    `loss_on_prompt`: also learn the target's distribution at prompt positions (loss_mask == 0).
    SpecForge masks them; on small captures they are extra in-domain signal for free.
    Records with NaN/Inf hidden states, shorter than 3 tokens, or without a position to learn
    (all cut off by `max_len`, or every target argmax outside the draft vocab) are dropped and
    counted in `dropped` (keys `non_finite`, `too_short`, `no_valid_positions`).
    """
    out = []
    dropped = Counter() if dropped is None else dropped
    t2d = t2d.to(target.device)  # the logits stay on the target's device: only [T, Vd] bf16 comes back
    cols = t2d.nonzero().squeeze(-1)
    for r in records:
        T = min(int(r["input_ids"].shape[0]), max_len)
        if T < 3:
            dropped["too_short"] += 1
            continue
        if not (torch.isfinite(r["hidden_states"][:T]).all() and torch.isfinite(r["aux_hidden_states"][:T]).all()):
            dropped["non_finite"] += 1
            continue
        with torch.no_grad():
            full = target.logits_from_hidden(r["hidden_states"][:T])  # [T, V] fp32 on the target's device
            in_vocab, tlogits = t2d[full.argmax(-1)].cpu(), full[:, cols].to(torch.bfloat16).cpu()
        keep = torch.ones(T, dtype=torch.bool) if loss_on_prompt else r["loss_mask"][:T].bool()
        valid = keep & in_vocab
        if not valid[1:].any():  # nothing to learn (e.g. generation cut off by max_len, or out of vocab)
            dropped["no_valid_positions"] += 1
            continue
        out.append(Example(r["aux_hidden_states"][:T].clone(), r["input_ids"][:T].long(), tlogits, valid, keep))
    return out


def group_by_length(lengths: list[int], max_tokens: int, shuffle: bool, rng: random.Random) -> list[list[int]]:
    """Positions 0..n-1 grouped into batches of at most `max_tokens` padded tokens (B·T_max):
    sorted by length (ties in position order), cut greedily; the groups shuffled by `rng` when
    `shuffle`. A sequence longer than `max_tokens` is a batch of its own."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups, cur = [], []
    for i in order:
        t = lengths[i]
        if cur and (len(cur) + 1) * t > max_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    if shuffle:
        rng.shuffle(groups)
    return groups


def _groups(examples: list[Example], max_tokens: int, shuffle: bool, rng: random.Random) -> list[list[int]]:
    return group_by_length([e.ids.shape[0] for e in examples], max_tokens, shuffle, rng)


def _pad(t: torch.Tensor, T: int, v=0) -> torch.Tensor:
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, T - t.shape[0]), value=v)


def collate(ex: list[Example], device: torch.device | str = "cpu") -> tuple[torch.Tensor, ...]:
    """One padded batch on `device`: (aux `[B,T,3H]`, ids `[B,T]`, tlogits `[B,T,Vd]`, valid
    `[B,T]`, key_valid `[B,T]` (not padding)), T the longest example."""
    T = max(e.ids.shape[0] for e in ex)
    batch = (torch.stack([_pad(e.ids, T) for e in ex]), torch.stack([_pad(e.tlogits, T) for e in ex]),
             torch.stack([_pad(e.valid, T, False) for e in ex]),
             torch.stack([_pad(torch.ones(e.ids.shape[0], dtype=torch.bool), T, False) for e in ex]))
    return (stack_aux(ex, T, device), *(t.to(device) for t in batch))


def stack_aux(ex: list[Example], T: int, device: torch.device | str) -> torch.Tensor:
    """The examples' aux, padded to T, as `[B, T, 3H]` fp32 on `device`: moved in the dtype the
    examples hold (bf16 from a snapshot: half the bytes of fp32 to copy), then cast there."""
    dt = ex[0].aux.dtype if all(e.aux.dtype == ex[0].aux.dtype for e in ex) else torch.float32
    return torch.stack([_pad(e.aux.to(dt), T) for e in ex]).to(device).float()


def batches(examples: list[Example], max_tokens: int, shuffle: bool, rng: random.Random,
            device: torch.device | str = "cpu"):
    """Length-bucketed padded batches (`collate`) of at most `max_tokens` (B·T_max) tokens."""
    for g in _groups(examples, max_tokens, shuffle, rng):
        yield collate([examples[i] for i in g], device)
