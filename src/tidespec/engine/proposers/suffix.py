"""Suffix proposer: a prefix of the request's suffix proposal, at no draft cost, and the per-class
correction of its scores (`SuffixEstimator`).

Source: SuffixDecoding (Oliaro et al., arXiv 2411.04975 §3–4): the proposal (`suffix.SuffixCache`,
looked up when the step is planned, since the policy sizes it by its chain scores) is the most
frequent continuation of the context's longest matching suffix, and its expected accepted tokens
are the sum of its chain scores, here times a per-class correction measured from what was accepted.
Deterministic, so for a sampled request its proposal distribution q is one-hot and rejection
sampling stays exact (Leviathan et al. 2023, arXiv 2211.17192 §2.3: any q works).
"""
from __future__ import annotations

import threading
from collections.abc import Mapping

from ..suffix_tree import Proposal, SuffixCache
from .base import Build, ProposerPolicy, ProposerSpec, Rung, Slot, one_hot

PRIOR = 1.0  # pseudo-proposals at correction 1.0 that a class's measured correction is shrunk towards
CONFIDENT_RANK, WEAK_RANK = 1, 3  # outside the policy: before the draft when confident, else only without one


class SuffixProposer:
    """The first `slot.n` tokens of the request's suffix proposal (`slot.offers["suffix"]`). cache: the engine's
    suffix cache; vocab_size: the
    target's V (one-hot q `[V]`); min_expected: outside the policy, the proposal is taken over the
    draft's when its expected accepted tokens (the sum of its chain scores) reach this. A seeded
    sampled request never takes suffix proposals (its output would depend on other traffic)."""

    name = "suffix"
    uses_draft = False
    gated = True

    def __init__(self, cache: SuffixCache, vocab_size: int, min_expected: float = 1.0):
        self.cache, self.vocab_size, self.min_expected = cache, vocab_size, min_expected

    def offer(self, sl: Slot, room: int, policy: ProposerPolicy | None) -> Rung | None:
        s = sl.seq
        if not s.req.speculative or room <= 0 or s.req.seeded:
            return None
        p = self.cache.propose(s.rid)
        sl.offers[self.name] = p = Proposal(p.tokens[:room], p.score, p.match_len, p.source, p.scores[:room])
        if not p.tokens:
            return None
        if sl.learn:
            return Rung(self.name, self, policy.estimator(self.name).gains(sl.workload, p.scores))
        rank = CONFIDENT_RANK if sum(p.scores) >= self.min_expected else WEAK_RANK
        return Rung(self.name, self, fixed=(rank, len(p.tokens), sum(p.scores)))

    def propose(self, slots: list[Slot]) -> None:
        """Drafts: the proposal's prefix; sampled requests get one-hot q `[V]` fp32 per token."""
        for sl in slots:
            sl.drafts = list(sl.offers[self.name].tokens[:sl.n])
            if sl.seq.rng is not None:
                sl.draft_probs = one_hot(self.vocab_size, sl.drafts)

    def observe(self, slot: Slot) -> None:
        """Nothing drafted past the proposal to roll back."""


class SuffixEstimator:
    """Per class: measured accepted ÷ expected (by the chain scores) of verified suffix proposals,
    running means for the first 1/alpha proposals, then EMAs. `settings`: `policy.PolicyConfig`."""

    def __init__(self, settings):
        self.alpha = settings.alpha
        self._lock = threading.Lock()
        self._st: dict[str, list] = {}  # class → [mean accepted, mean expected, proposals]

    def reset(self, replayed: Mapping[str, tuple[float, float]] | None = None) -> None:
        with self._lock:
            self._st.clear()

    def correction(self, workload: str) -> float:
        """Accepted / expected, shrunk towards 1.0 by PRIOR pseudo-proposals: (w·r + 1) / (w + 1), w
        the proposals seen (at most 1/alpha: the EMA's memory). One wrong proposal halves it and it
        never reaches 0 (at 0 a class's proposals would never be chosen, hence never measured
        again). 1.0 until measured; at most 2."""
        with self._lock:
            acc, exp, n = self._st.get(workload, (1.0, 1.0, 0))
        if exp <= 0 or n == 0:
            return 1.0
        w = min(n, 1.0 / self.alpha)
        return min(2.0, (w * acc / exp + PRIOR) / (w + PRIOR))

    def gains(self, workload: str, scores: tuple[float, ...] | list[float]) -> tuple[float, ...]:
        """Expected accepted tokens for the first m = 1..len tokens of a proposal whose chain scores
        (cumulative conditional frequencies) are `scores`, corrected; a position adds at most 1."""
        c, out = self.correction(workload), []
        for x in scores:
            out.append((out[-1] if out else 0.0) + min(1.0, c * x))
        return tuple(out)

    def observe(self, slot: Slot) -> None:
        self.observe_proposal(slot.workload, sum(slot.offers[SuffixProposer.name].scores[:slot.k]), slot.accepted)

    def observe_proposal(self, workload: str, expected: float, accepted: int) -> None:
        """A verified proposal: its expected accepted tokens (sum of chain scores) and the accepted count."""
        if expected > 0:
            with self._lock:
                st = self._st.setdefault(workload, [0.0, 0.0, 0])
                st[2] += 1
                w = max(self.alpha, 1.0 / st[2])
                st[0] += w * (accepted - st[0])
                st[1] += w * (expected - st[1])

    def report(self, workload: str) -> dict:
        return {"suffix_correction": round(self.correction(workload), 4)}

    def classes(self) -> set[str]:
        with self._lock:
            return set(self._st)


def _build(b: Build) -> SuffixProposer | None:
    return None if b.suffix is None else SuffixProposer(b.suffix, b.vocab_size, b.cfg.suffix.min_expected)


SPEC = ProposerSpec(SuffixProposer, rung=2, estimator=SuffixEstimator, build=_build)
