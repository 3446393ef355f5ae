"""What a proposer is (`Proposer`) and what it works on (`Slot`: one running request's share of one
engine step). The shape follows vLLM's `v1/spec_decode/` (one class per method with `propose()`);
the step that drives them is `engine.speculative.Engine.step`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ...models.eagle3 import DraftRunner
from ..adaptive import AdaptiveK
from ..request import Seq
from ..suffix import Proposal
from ..tree import Layout


@dataclass(eq=False)
class Slot:
    """One running request in one step: the plan's choice for it, what its proposer drafted, what
    verification accepted. Discarded after the step (the request's lasting state is `seq`).

    Set by the plan (`engine.plan`): proposer (None: no drafts, the step verifies one row), n (the
    option's size: chain length k, suffix prefix length, or verified tree nodes), depth (tree depth:
    draft forwards), cap (most tree nodes the KV and output room allow), stop_below (early-stop /
    tree-widening threshold on the estimated probability that a further token is reached and
    accepted, 0 = off), proposal (its suffix proposal, capped to the room), learn (the policy that
    learns from this request's verifications; None when the request is outside the policy).
    Set by the EAGLE3 catch-up: hidden `[1, H]` and logits `[Vd]` fp32, the draft's chain start.
    Set by `Proposer.propose`: drafts (target ids), draft_probs (one proposal distribution `[V]`
    fp32 per draft, sampled requests only), layout (a verified tree's rows; None: a chain), base
    (the draft cache length before drafting, the rollback point), stopped / reach / confs (chain
    early stop: cut, the estimated probability that the last draft is reached and accepted, the
    draft's probability of each draft), draft_forwards / draft_rows (the batched draft forwards it joined and the rows it fed to
    each: what the cost model charges). Set by acceptance: accepted (drafts accepted).
    """

    seq: Seq
    proposer: Proposer | None = None
    n: int = 0
    depth: int = 0
    cap: int = 0
    stop_below: float = 0.0
    proposal: Proposal | None = None
    forced: tuple[int, ...] = ()
    learn: AdaptiveK | None = None
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    drafts: list[int] = field(default_factory=list)
    draft_probs: list[torch.Tensor] = field(default_factory=list)
    layout: Layout | None = None
    base: int = 0
    stopped: bool = False
    reach: float = 1.0
    confs: list[float] = field(default_factory=list)
    draft_forwards: int = 0
    draft_rows: int = 1
    accepted: int = 0

    @property
    def k(self) -> int:
        """Drafted tokens: the verify rows after the first (the last emitted token)."""
        return len(self.drafts)

    @property
    def version(self) -> str | None:
        """The draft version the request runs (`Seq.version`)."""
        return self.seq.version


class Proposer(Protocol):
    """A source of draft tokens for the requests the plan gives it.

    name: the goodput policy's option (`goodput.Ladder`) and the key of the request's counters
    (`Generation.stats_by_proposer`): "eagle3", "suffix" or "grammar".
    A new proposer implements these two methods and is registered in the engine's proposer table
    (`Engine._proposers`); the plan offers it through the request's `Ladder`.
    """

    name: str

    def propose(self, slots: list[Slot]) -> None:
        """Draft for these requests (all of them this proposer's this step) up to each slot's `n`:
        fill `drafts`, `draft_probs` for sampled requests (rejection sampling needs q), `layout`
        for a tree, and `draft_forwards` / `draft_rows`. Raises what its draft forward raises (the
        step then fails for every request in it)."""
        ...

    def observe(self, slot: Slot) -> None:
        """After verification accepted `slot.accepted` of `slot.drafts`: roll back what was
        drafted past them and teach `slot.learn` (when set). Raises only on a bug (the request fails)."""
        ...


def one_hot(vocab_size: int, tokens: list[int]) -> list[torch.Tensor]:
    """The proposal distribution q `[V]` fp32 of each token of a deterministic proposal (one-hot):
    what rejection sampling needs from a suffix or grammar proposal for a sampled request."""
    return [torch.zeros(vocab_size).index_fill_(0, torch.tensor([t]), 1.0) for t in tokens]


def by_draft(slots: list[Slot]):
    """(draft, its slots) groups: requests keep the draft they started with, so after a hot-swap one
    step may hold two drafts; each group runs one batched draft forward."""
    drafts: dict[int, DraftRunner] = {id(sl.seq.draft): sl.seq.draft for sl in slots}
    for draft in drafts.values():
        yield draft, [sl for sl in slots if sl.seq.draft is draft]
