"""Suffix proposer: a prefix of the request's suffix proposal, at no draft cost.

Source: SuffixDecoding (Oliaro et al., arXiv 2411.04975 §3–4): the proposal (`suffix.SuffixCache`,
looked up when the step is planned, since the policy sizes it by its chain scores) is the most
frequent continuation of the context's longest matching suffix. Deterministic, so for a sampled
request its proposal distribution q is one-hot and rejection sampling stays exact (Leviathan et al.
2023, arXiv 2211.17192 §2.3: any q works).
"""
from __future__ import annotations

from .base import Slot, one_hot


class SuffixProposer:
    """The first `slot.n` tokens of `slot.proposal`. vocab_size: the target's V (one-hot q `[V]`)."""

    name = "suffix"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def propose(self, slots: list[Slot]) -> None:
        """Drafts: the proposal's prefix; sampled requests get one-hot q `[V]` fp32 per token."""
        for sl in slots:
            sl.drafts = list(sl.proposal.tokens[:sl.n])
            if sl.seq.rng is not None:
                sl.draft_probs = one_hot(self.vocab_size, sl.drafts)

    def observe(self, slot: Slot) -> None:
        """Teach the policy the expected (sum of the prefix's chain scores) vs accepted tokens."""
        if slot.learn is not None:
            slot.learn.observe_suffix(slot.seq.req.workload, sum(slot.proposal.scores[:slot.k]), slot.accepted)
