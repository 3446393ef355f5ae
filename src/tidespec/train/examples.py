"""Training examples from capture records: the target's next-token distribution at every position (from the
captured last hidden state through its lm_head), mapped into the draft vocabulary (`prepare`). What the draft
does with them (batches, the TTT loss, the holdout's outcomes) is `models.ttt`."""

from __future__ import annotations

from collections import Counter

import torch

from ..models.target import Target
from ..models.ttt import Example


def prepare(records: list[dict], target: Target, t2d: torch.Tensor, max_len: int,
            loss_on_prompt: bool = False, dropped: Counter | None = None,
            rejected_weight: float = 0.0) -> list[Example]:
    """Turn capture records into examples (target logits computed once, restricted to the draft vocab).

    `loss_on_prompt`: also learn the target's distribution at prompt positions (loss_mask == 0).
    SpecForge masks them; on small captures they are extra in-domain signal for free.
    `rejected_weight` w > 0: an example of a record with `rejected_mask` (`capture.store.read_record`)
    gets weight 1 + w at the positions the serving draft got wrong, 1 elsewhere (`Example.weight`).
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
        weight = None
        if rejected_weight and "rejected_mask" in r:
            weight = 1.0 + rejected_weight * r["rejected_mask"][:T].float()
        out.append(Example(r["aux_hidden_states"][:T].clone(), r["input_ids"][:T].long(), tlogits, valid, keep,
                           weight))
    return out

