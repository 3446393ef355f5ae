"""Grammar proposer: the tokens a request's grammar forces next, at no draft cost (jump-forward).

Where a constrained request's grammar allows one continuation — a JSON key and its `": "`, the
`", "` between items, an enum literal once its first letters decide it, closing brackets, a tool
call's fixed envelope — those bytes are known without any draft. llguidance tokenizes them
(`GrammarState.forced`: the last token is held back while a longer token could still cover it).
Jump-forward decoding emits such tokens without the target (SGLang, Zheng et al. 2024, arXiv
2312.07104 §4); here they are *proposed* and verified like any draft, so the output stays exactly the
constrained target's (the target may tokenize the forced bytes differently: then verification cuts
there). Deterministic, so for a sampled request q is one-hot and rejection sampling stays exact.
The forced tokens are looked up when the step is planned (`plan.Planner`: the policy sizes the
option by them) and kept on the slot (`Slot.forced`).
"""
from __future__ import annotations

from .base import Slot, one_hot


class GrammarProposer:
    """The first `slot.n` forced tokens (`slot.forced`). vocab_size: the target's V (one-hot q `[V]`)."""

    name = "grammar"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def propose(self, slots: list[Slot]) -> None:
        """Drafts: the forced tokens' prefix; sampled requests get one-hot q `[V]` fp32 per token."""
        for sl in slots:
            sl.drafts = list(sl.forced[:sl.n])
            if sl.seq.rng is not None:
                sl.draft_probs = one_hot(self.vocab_size, sl.drafts)

    def observe(self, slot: Slot) -> None:
        """Teach the policy how many of the proposed forced tokens the target accepted."""
        if slot.learn is not None:
            slot.learn.observe_grammar(slot.seq.req.workload, slot.k, slot.accepted)
