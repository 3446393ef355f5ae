"""The draft's training-time test (TTT: EAGLE-3, arXiv 2503.01840 §3.2) on teacher-forced examples: the
padded batches `Eagle3Draft.ttt_forward` reads (`collate`, `batches`), the loss the trainer minimises
(`ttt_loss`) and the per-step outcomes a holdout is scored on (`ttt_outcomes`).

An `Example` is one sequence with the target's next-token distribution at every position, restricted to
the draft vocabulary (`train.examples.prepare` builds them from capture records). TTT step j at row t
is the draft's (j+1)-th chained token after position t, fed the example's tokens t+1..t+1+j (teacher
forcing), and is held to the target's distribution at position t+1+j (`step_targets`).
"""
from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .eagle3 import Eagle3Draft


@dataclass
class Example:
    """One training sequence: aux `[T, 3H]` as the record holds it (bf16 from a snapshot; cast to
    fp32 on the training device, `collate`), ids `[T]` int64, target logits over the draft
    vocab `[T, Vd]` bf16, valid `[T]` bool (learnable position: kept by the loss mask, and its
    target argmax is in the draft vocab), keep `[T]` bool (kept by the loss mask, whatever the
    argmax: the positions a draft is evaluated on; None = same as valid), weight `[T]` float32 (the
    loss weight of position t as a target, `train.rejected_weight`; None = 1 everywhere)."""

    aux: torch.Tensor
    ids: torch.Tensor
    tlogits: torch.Tensor
    valid: torch.Tensor
    keep: torch.Tensor | None = None
    weight: torch.Tensor | None = None


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
    `[B,T]`, key_valid `[B,T]` (not padding), weight `[B,T]` float32 or None when no example has one),
    T the longest example."""
    T = max(e.ids.shape[0] for e in ex)
    batch = (torch.stack([_pad(e.ids, T) for e in ex]), torch.stack([_pad(e.tlogits, T) for e in ex]),
             torch.stack([_pad(e.valid, T, False) for e in ex]),
             torch.stack([_pad(torch.ones(e.ids.shape[0], dtype=torch.bool), T, False) for e in ex]))
    weight = None
    if any(e.weight is not None for e in ex):
        weight = torch.stack([_pad(torch.ones(e.ids.shape[0]) if e.weight is None else e.weight.float(), T)
                              for e in ex]).to(device)
    return (stack_aux(ex, T, device), *(t.to(device) for t in batch), weight)


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


def step_targets(tlogits: torch.Tensor, valid: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TTT step j's targets for a padded batch (tlogits `[B,T,Vd]`, valid `[B,T]`): row t is held
    to position t+1+j. Returns (target logits `[B,T,Vd]`, learnable `[B,T]` bool), zero / False
    where t+1+j is past the end."""
    return F.pad(tlogits[:, 1 + j:], (0, 0, 0, 1 + j)), F.pad(valid[:, 1 + j:], (0, 1 + j), value=False)


def ttt_loss(draft: Eagle3Draft, aux, ids, tlogits, valid, key_valid, weight, steps: int, decay: float,
             denom: int | None = None, objective: str = "kl"):
    """Returns (loss, [correct_j], [count_j]) for one padded batch (`collate`'s).

    aux `[B,T,3H]`, ids `[B,T]`, tlogits `[B,T,Vd]`, valid/key_valid `[B,T]` bool, weight `[B,T]`
    float32 or None: the per-row loss of a row held to position p is multiplied by weight[p] (at every
    TTT step: each step's attempt at that token; the positions the serving draft got wrong, as Aurora
    (arXiv 2602.06932) separates accepted from rejected tokens); None: all 1.
    Step j row t is trained on the target distribution at position t+1+j. As SpecForge
    (`core/loss.py`), L_j sums a per-row loss over step j's valid rows and divides by all
    (non-padding) positions, so later steps, with fewer valid rows, weigh less. `denom`: that
    position count when this batch is one rank's share of a global batch (the global batch's).
    The per-row loss (`row_loss`): `objective` "kl" the cross-entropy −Σ_v p(v) log q(v) (KL(p‖q) up to
    p's entropy), "lk" −log α with α = Σ_v min(p(v), q(v)), the acceptance probability of a draft
    token under speculative sampling (LK losses, Samarin et al., arXiv 2602.23881).
    """
    hs = draft.ttt_forward(aux, ids, steps, key_valid)
    loss = torch.zeros((), device=aux.device)
    denom = max(int(key_valid.sum()) if denom is None else denom, 1)
    correct, count = [], []
    for j, h in enumerate(hs):
        tl, m = step_targets(tlogits, valid, j)
        n = int(m.sum())
        if n == 0:
            correct.append(0)
            count.append(0)
            continue
        logits = draft.logits(h[m])  # only valid rows pay for the lm_head
        tp = torch.softmax(tl[m].float(), -1)
        if weight is not None:
            lj = (row_loss(tp, logits, objective) * F.pad(weight[:, 1 + j:], (0, 1 + j))[m]).sum() / denom
        elif objective == "kl":  # one sum over the rows and the vocabulary, as before the objective was a choice
            lj = -(tp * torch.log_softmax(logits, -1)).sum() / denom
        else:
            lj = row_loss(tp, logits, objective).sum() / denom
        loss = loss + decay ** j * lj
        correct.append(int((logits.argmax(-1) == tp.argmax(-1)).sum()))
        count.append(n)
    return loss, correct, count


def row_loss(p: torch.Tensor, logits: torch.Tensor, objective: str) -> torch.Tensor:
    """Per-row loss of the draft's `logits` `[N, Vd]` against the target's distribution `p` `[N, Vd]`
    (float32, rows sum to 1), by `objective`: "kl" −Σ_v p log softmax(logits), "lk" −log Σ_v min(p, softmax(logits))
    (in log space, −logsumexp_v min(log p, log q): finite, with a gradient, however little the draft puts
    where the target does). Returns `[N]` float32. Raises ValueError for another `objective`."""
    if objective == "kl":
        return -(p * torch.log_softmax(logits, -1)).sum(-1)
    if objective == "lk":
        return -torch.logsumexp(torch.minimum(torch.log(p), torch.log_softmax(logits.float(), -1)), -1)
    raise ValueError(f"train.loss {objective!r}: use kl or lk")


class TTTOutcomes(NamedTuple):
    """What `ttt_outcomes` measured. acc: `steps` floats in [0, 1], the top-1 agreement per TTT step
    over the rows whose target at that step is learnable (empty when no chain could start); seqs:
    per sequence with a chain start, (the chain-start positions, right `[n, steps]` bool: step j
    right there)."""

    acc: list[float]
    steps: int
    seqs: list[tuple[list[int], torch.Tensor]]


def ttt_outcomes(draft: Eagle3Draft, chunks: Iterable[list[Example]], steps: int, batch_tokens: int) -> TTTOutcomes:
    """Teacher-forced outcomes of `draft` (greedy, no grad) over `chunks` of examples (one list, or
    one buffer in memory at a time: the outcomes are per row, chunking does not change them),
    batched by `batch_tokens` tokens, `steps` TTT steps. A chain can start at a row whose next token
    was generated (`Example.keep`); a target token outside the draft vocab is a wrong step (the
    draft cannot propose it), and so is a step past the end of the sequence."""
    corr, cnt = [0] * steps, [0] * steps
    seqs: list[tuple[list[int], torch.Tensor]] = []
    dev = draft.fc.weight.device
    with torch.no_grad():
        for examples, g in ((ex, g) for ex in chunks for g in _groups(ex, batch_tokens, False, random.Random(0))):
            ex = [examples[i] for i in g]
            aux, ids, tl, valid, kv, _ = collate(ex, dev)
            keep = torch.stack([_pad(e.valid if e.keep is None else e.keep, ids.shape[1], False) for e in ex]).to(dev)
            right = []
            for j, h in enumerate(draft.ttt_forward(aux, ids, steps, kv)):
                tgt, m = step_targets(tl, valid, j)  # m: step j's target position is learnable
                r = torch.zeros_like(m)
                if m.any():
                    r[m] = draft.logits(h[m]).argmax(-1) == tgt[m].float().argmax(-1)
                corr[j] += int(r.sum())
                cnt[j] += int(m.sum())
                right.append(r)
            right_ = torch.stack(right, -1)  # [B, T, steps]
            start = F.pad(keep[:, 1:], (0, 1), value=False)  # rows whose next token was generated
            for b in range(len(ex)):
                pos = start[b].nonzero().squeeze(-1)
                if pos.numel():
                    seqs.append((pos.tolist(), right_[b, pos].cpu()))
    acc = [a / n if n else 0.0 for a, n in zip(corr, cnt)] if seqs else []
    return TTTOutcomes(acc, steps, seqs)
