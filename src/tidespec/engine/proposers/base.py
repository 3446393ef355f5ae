"""What a proposer is and what it works on, after vLLM's `v1/spec_decode/` (one class per method).

A proposer (`Proposer`) offers each request a rung of options (`Rung`: n = 1..N drafted tokens and
their expected accepted tokens), drafts for the requests the plan gives it (`propose`), and rolls
back what verification rejected (`observe`). Its estimator (`Estimator`) learns, per workload
class, how much of what it proposes is accepted. A proposer joins an engine by the spec its own
module declares (`ProposerSpec`), listed in the engine's `registry.ProposerRegistry`; the goodput
policy searches over the proposers of that registry. What a proposer may ask the policy is
`ProposerPolicy`, nothing more. The step that drives them is `engine.speculative.Engine.step`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from ..draft_tree import Layout
from ..request import Seq

if TYPE_CHECKING:
    from ...config import EngineParams
    from ..suffix_tree import SuffixCache


@dataclass(frozen=True)
class Rung:
    """One proposer's options for one request this step: n = 1..len(gains) drafted tokens.

    kind: the proposer's name (`Proposer.name`: the option's key, its estimator's and its counters');
    proposer: the object that drafts it; gains[n-1]: expected accepted tokens with n drafted
    (cumulative; empty outside the policy); drafts: it runs draft-model forwards (a catch-up over
    the rows verified last step, then one forward per position), else it costs verify rows only;
    depth[n-1]: draft forwards of option n (() = n, a chain); draft_rows: rows each forward feeds
    per request (1 a chain, topk a tree); catch_up_ms: what drafting now adds for the draft's
    catch-up over a long backlog, amortised (`StepCost.catch_up_ms`; the plan's objective counts
    it, a step's predicted wall time does not). fixed: outside the policy (a fixed k, a seeded
    request) the option (rank, n, expected accepted) it claims; the claim of lowest rank wins.
    """

    kind: str
    proposer: object
    gains: tuple[float, ...] = ()
    drafts: bool = False
    depth: tuple[int, ...] = ()
    draft_rows: int = 1
    catch_up_ms: float = 0.0
    fixed: tuple[float, int, float] | None = None

    def depth_of(self, n: int) -> int:
        """Draft forwards (chain positions / tree depth) of option n; 0 for a rung that runs none."""
        if not self.drafts or not n:
            return 0
        return self.depth[n - 1] if self.depth else n


@dataclass(eq=False)
class Slot:
    """One running request in one step: the plan's choice for it, what its proposer drafted, what
    verification accepted. Discarded after the step (the request's lasting state is `seq`).

    Set by the plan (`engine.plan`): proposer (None: no drafts, the step verifies one row), n (the
    option's size: chain length k, suffix prefix length, or verified tree nodes), depth (tree depth:
    draft forwards), cap (most tree nodes the KV and output room allow), stop_below (early-stop /
    tree-widening threshold on the estimated probability that a further token is reached and
    accepted, 0 = off), learn (the request is under the goodput policy), estimator (its proposer's
    estimator when it is: what verification teaches). Set by `Proposer.offer`: offers (what each
    proposer computed for the request, by kind: a suffix proposal, the grammar's forced tokens).
    Set by the draft's catch-up (`catch_up`): hidden `[1, H]` and logits `[Vd]` fp32, the draft's
    chain start. Set by `Proposer.propose`: drafts (target ids), draft_probs (one proposal
    distribution `[V]` fp32 per draft, sampled requests only), layout (a verified tree's rows;
    None: a chain), base (the draft cache length before drafting, the rollback point), stopped /
    reach / confs (chain early stop: cut, the estimated probability that the last draft is reached
    and accepted, the draft's probability of each draft), draft_forwards / draft_rows (the batched
    draft forwards it joined and the rows it fed to each:
    what the cost model charges). Set by acceptance: accepted (drafts accepted).
    """

    seq: Seq
    proposer: Proposer | None = None
    n: int = 0
    depth: int = 0
    cap: int = 0
    stop_below: float = 0.0
    offers: dict[str, object] = field(default_factory=dict)
    learn: bool = False
    estimator: Estimator | None = None
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
    def workload(self) -> str:
        """The request's workload class (the estimators' key)."""
        return self.seq.req.workload


@dataclass(frozen=True)
class Build:
    """What a proposer is built from (`ProposerSpec.make`): the engine's config (`EngineParams`, whole),
    the target's vocabulary size V, the engine's suffix cache (None: no suffix proposer) and
    whether constrained requests propose their grammar's forced tokens."""

    cfg: EngineParams
    vocab_size: int
    suffix: SuffixCache | None = None
    forced_tokens: bool = True


class Estimator(Protocol):
    """A proposer's acceptance estimate per workload class, learned from verified proposals."""

    def observe(self, slot: Slot) -> None:
        """Learn from one verified proposal (`slot.drafts`, `slot.accepted`)."""
        ...

    def reset(self, replayed: Mapping[str, tuple[float, float]] | None = None) -> None:
        """Forget what was learned (a new draft serves); `replayed`: the draft's replayed first-token
        acceptance per class {class: (a₁, chains)} ("" over all classes), for a draft model's prior."""
        ...

    def report(self, workload: str) -> dict:
        """What it holds for one class (JSON values), for /health and the benchmarks."""
        ...

    def classes(self) -> set[str]:
        """The classes it has observed."""
        ...


class ProposerPolicy(Protocol):
    """What a proposer may ask the goodput policy (`policy.GoodputPolicy` implements it) when it
    offers a request its options: k_max, the longest chain (or tree depth) the policy times; the
    estimator of a kind (`Estimator`; KeyError for a kind the policy was not built with); the
    draft's amortised catch-up (ms) a request's backlog would cost now (`StepCost.catch_up_ms`)."""

    k_max: int

    def estimator(self, kind: str) -> Estimator:
        ...

    def catch_up_ms(self, s: Seq) -> float:
        ...


class Proposer(Protocol):
    """A source of draft tokens. name: its kind (the option's key, its estimator's and its counters'
    `Generation.by_proposer`, the `proposer` label on /metrics); uses_draft: it runs the request's
    draft model (the engine catches the draft up first, `catch_up`; the plan charges that
    catch-up, probes the class while it is off, and keeps it on with hysteresis; its counters are
    the draft model's, `Generation.draft_stats`; a chain of it teaches the draft's health its
    first-token acceptance); gated: computing its offer costs, so the policy stops computing it for
    a class where the plan leaves it unchosen."""

    name: ClassVar[str]
    uses_draft: ClassVar[bool]
    gated: ClassVar[bool]

    def offer(self, slot: Slot, room: int, policy: ProposerPolicy | None) -> Rung | None:
        """This request's options this step, at most `room` tokens (its output and KV room, the bonus
        token excluded); None when it has nothing to propose. `policy`: the goodput policy (None:
        the engine has none), whose estimator for this kind gives the gains when `slot.learn`. Keeps
        what it computed for `propose` in `slot.offers[name]`."""
        ...

    def propose(self, slots: list[Slot]) -> None:
        """Draft for these requests (all of them this proposer's this step) up to each slot's `n`:
        fill `drafts`, `draft_probs` for sampled requests (rejection sampling needs q), `layout`
        for a tree, and `draft_forwards` / `draft_rows`. Raises what its draft forward raises (the
        step then fails for every request in it)."""
        ...

    def observe(self, slot: Slot) -> None:
        """After verification accepted `slot.accepted` of `slot.drafts`: roll back what was drafted
        past them. Raises only on a bug (the request fails)."""
        ...


@dataclass(frozen=True)
class ProposerSpec:
    """How a proposer joins an engine, declared by its own module (`SPEC`) and listed in a
    `registry.ProposerRegistry`. cls: its class (with `name`, `uses_draft`, `gated`, `offer`,
    `propose`, `observe`); rung: its place in every request's ladder and in a step's drafting order
    (lower first); estimator: the estimator of its kind, built from the policy's settings
    (`policy.PolicyConfig`; proposers of one kind share one); build: the proposer for an engine
    (None: it does not run there, e.g. the suffix proposer without a suffix cache; default `cls()`)."""

    cls: type
    rung: int
    estimator: Callable[[object], Estimator]
    build: Callable[[Build], Proposer | None] | None = None

    def make(self, b: Build) -> Proposer | None:
        """The proposer for an engine built from `b` (None: it does not run there)."""
        return self.build(b) if self.build is not None else self.cls()


def one_hot(vocab_size: int, tokens: list[int]) -> list[torch.Tensor]:
    """The proposal distribution q `[V]` fp32 of each token of a deterministic proposal (one-hot):
    what rejection sampling needs from a suffix or grammar proposal for a sampled request."""
    return [torch.zeros(vocab_size).index_fill_(0, torch.tensor([t]), 1.0) for t in tokens]


def by_draft(slots: list[Slot]):
    """(draft, its slots) groups: requests keep the draft they started with, so after a hot-swap one
    step may hold two drafts; each group runs one batched draft forward."""
    drafts = {id(sl.seq.draft): sl.seq.draft for sl in slots}
    for draft in drafts.values():
        yield draft, [sl for sl in slots if sl.seq.draft is draft]


def catch_up(slots: list[Slot]) -> None:
    """Feed each request's backlog — verified rows the draft has not read: aux `[n, 3H]`, next tokens
    `[n]` — to its draft, one batched forward per draft (every proposer that uses the draft model
    together), and set the chain start `slot.hidden` `[1, H]` / `slot.logits` `[Vd]` fp32. Slots
    without a backlog are left."""
    for draft, group in by_draft([sl for sl in slots if sl.seq.backlog]):
        backlogs = [sl.seq.drain() for sl in group]
        items = [(torch.cat([a for a, _ in b]), torch.cat([t for _, t in b]), sl.seq.draft_cache)
                 for sl, b in zip(group, backlogs)]
        for sl, (h, dl) in zip(group, draft.extend_batch(items)):
            sl.hidden, sl.logits = h, dl
