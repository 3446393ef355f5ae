"""EAGLE3 chain proposer: k tokens per request, one batched draft forward per position, and the
estimate of its acceptance (`Eagle3Estimator`, shared with EAGLE-2 trees: `proposers.tree`).

Source: EAGLE-3 (Li et al., arXiv 2503.01840 §3): the draft reads the target's low/mid/high aux
hidden states `[n, 3*H]` of the verified rows (`base.catch_up`), then drafts autoregressively,
feeding its own hidden state `[1, H]` forward. Early stop (requests under the goodput policy with
`draft_early_stop`): SpecDec++ (arXiv 2405.19715 §3) stops at a threshold on the predicted rejection
probability; here the threshold is the step's break-even (`GoodputPolicy.stop_below`) and the
acceptance of a token is estimated from the draft's confidence in it (EAGLE-2, arXiv 2406.16858 §4).
"""
from __future__ import annotations

import torch

from ..sampling import warp
from .base import Build, ProposerPolicy, ProposerSpec, Rung, Slot, by_draft
from .eagle3_estimate import Eagle3Estimator

FIXED_RANK = 2  # outside the policy: after a grammar's ≥ 2 forced tokens and a confident suffix proposal


def draft_token(sl: Slot, j: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Draft token j from the draft's logits `sl.logits` `[Vd]`: a target id `[1]` int64 and, when
    sampling, its proposal distribution `[V]` fp32. With logits transforms the draft's logits are
    mapped into the target vocab and transformed with prefix drafts[:j], so the proposal follows the
    same rules as the verification (rejection sampling stays exact). (None, None) when the
    transforms leave the draft no token (a grammar allowing only tokens outside its vocabulary)."""
    s = sl.seq
    if s.lp.active:
        x = s.lp.apply(s.draft.to_target_logits(sl.logits)[None], sl.drafts, start=j)[0]
        if not bool(torch.isfinite(x).any()):
            return None, None
        if s.rng is None:
            return x.argmax().view(1), None
        q = warp(x, s.req.sampling)
    elif s.rng is None:
        return s.draft.to_target_ids(sl.logits.argmax().view(1)), None
    else:
        q = s.draft.to_target_probs(warp(sl.logits, s.req.sampling))
    return torch.multinomial(q, 1, generator=s.rng), q


class Eagle3Chain:
    """EAGLE3 chains (module docstring) for requests that do not draft trees. `offer`: k = 1..room
    under the policy (gains from the class's conditional acceptance), else the request's k (or
    num_draft_tokens); `propose` drafts `slot.n` tokens per request (fewer with early stop);
    `observe` rolls the draft cache back to before the chain (the accepted rows are re-read as the
    next step's catch-up)."""

    name = "eagle3"
    uses_draft = True
    gated = False

    def __init__(self, k: int = 4):
        self.k = k

    def offer(self, sl: Slot, room: int, policy: ProposerPolicy | None) -> Rung | None:
        s = sl.seq
        if s.draft is None or s.tree:
            return None
        est = policy.estimator(self.name) if policy is not None else None
        if sl.learn:
            gains = est.gains(sl.workload, room)
            return Rung(self.name, self, gains, drafts=True, catch_up_ms=policy.catch_up_ms(s) if gains else 0.0)
        k = s.req.k if s.req.k is not None else self.k
        return Rung(self.name, self, drafts=True, fixed=(FIXED_RANK, k, est.gains(sl.workload, k)[-1] if est else 0.0))

    def propose(self, slots: list[Slot]) -> None:
        """Draft forwards batched across requests per position j (requests still drafting at j)."""
        for sl in slots:
            sl.base = sl.seq.draft_cache.length
        live, last = list(slots), {}
        for j in range(max((sl.n for sl in slots), default=0)):
            live = [sl for sl in live if sl.n > j]
            for sl in live:
                last[sl] = self._draft(sl, j)
            live = [sl for sl in live if not sl.stopped]
            for draft, group in by_draft([sl for sl in live if sl.n > j + 1]):
                steps = draft.step_batch([(sl.hidden, last[sl].view(1), sl.seq.draft_cache) for sl in group])
                for sl, (h, dl) in zip(group, steps):
                    sl.hidden, sl.logits = h, dl
        for sl in slots:
            sl.draft_forwards, sl.draft_rows = sl.k + sl.stopped, 1

    @staticmethod
    def _draft(sl: Slot, j: int) -> torch.Tensor:
        """Draft token j into `sl.drafts` (and its q into `sl.draft_probs`), unless the early stop
        ends the chain before it: the probability that it is reached and accepted — the product over
        i ≤ j of P(accept | draft confidence) — fell below `sl.stop_below` (then `sl.stopped`; the
        token drawn is discarded: verification never sees it, so sampling stays exact). At least one
        token is drafted, so acceptance keeps being measured — unless the request's grammar allows
        none of the draft's tokens (then the chain ends, `sl.stopped`)."""
        d, q = draft_token(sl, j)
        if d is None:  # nothing the draft could propose is allowed: the chain ends before j
            sl.stopped = True
            return torch.zeros(1, dtype=torch.int64)
        if sl.stop_below > 0:  # the draft's probability of the token it drafted
            conf = float(q[d]) if q is not None else float(torch.softmax(sl.logits, -1).max())
            reach = sl.reach * sl.estimator.accept_given_confidence(sl.workload, conf)
            if j > 0 and reach < sl.stop_below:
                sl.stopped = True
                return d
            sl.reach = reach
            sl.confs.append(conf)
        if q is not None:
            sl.draft_probs.append(q)
        sl.drafts.append(int(d))
        return d

    def observe(self, slot: Slot) -> None:
        """Roll the draft cache back to `slot.base`."""
        slot.seq.draft_cache.length = slot.base


def _build(b: Build) -> Eagle3Chain:
    return Eagle3Chain(b.cfg.num_draft_tokens)


SPEC = ProposerSpec(Eagle3Chain, rung=0, estimator=Eagle3Estimator, build=_build)
