"""Grammar proposer: the tokens a request's grammar forces next, at no draft cost (jump-forward), and
their measured acceptance per class (`GrammarEstimator`).

Where a constrained request's grammar allows one continuation — a JSON key and its `": "`, the
`", "` between items, an enum literal once its first letters decide it, closing brackets, a tool
call's fixed envelope — those bytes are known without any draft; llguidance tokenizes them
(`GrammarState.forced`). Jump-forward decoding emits such tokens without the target (SGLang, Zheng
et al. 2024, arXiv 2312.07104 §4); here they are *proposed* and verified like any draft, so the
output stays exactly the constrained target's (the target may tokenize the forced bytes
differently: verification cuts there). Deterministic: for a sampled request q is one-hot.
"""
from __future__ import annotations

import threading
from collections.abc import Mapping

from .base import Build, ProposerPolicy, ProposerSpec, Rung, Slot, one_hot

PRIOR = 0.95  # acceptance of a forced token before 8 were measured (forced bytes are certain)
RANK_MANY, RANK_ONE = 0, 4  # outside the policy: ≥ 2 forced tokens first; a single one only when nothing else offers


class GrammarProposer:
    """The first `slot.n` forced tokens (`slot.offers["grammar"]`, looked up at `offer`). vocab_size: the
    target's V (one-hot q `[V]`); k: the engine's num_draft_tokens (most forced tokens outside the
    policy without a request k)."""

    name = "grammar"
    uses_draft = False
    gated = False

    def __init__(self, vocab_size: int, k: int = 4):
        self.vocab_size, self.k = vocab_size, k

    def offer(self, sl: Slot, room: int, policy: ProposerPolicy | None) -> Rung | None:
        s = sl.seq
        if s.lp.grammar is None or not s.req.speculative or room <= 0:
            return None
        sl.offers[self.name] = f = tuple(s.lp.grammar.forced()[:room])
        if not f:
            return None
        if sl.learn:
            return Rung(self.name, self, policy.estimator(self.name).gains(sl.workload, len(f)))
        n = min(len(f), s.req.k if s.req.k is not None else self.k)
        return Rung(self.name, self, fixed=(RANK_MANY if len(f) >= 2 else RANK_ONE, n, float(n)))

    def propose(self, slots: list[Slot]) -> None:
        """Drafts: the forced tokens' prefix; sampled requests get one-hot q `[V]` fp32 per token."""
        for sl in slots:
            sl.drafts = list(sl.offers[self.name][:sl.n])
            if sl.seq.rng is not None:
                sl.draft_probs = one_hot(self.vocab_size, sl.drafts)

    def observe(self, slot: Slot) -> None:
        """Nothing to roll back."""


class GrammarEstimator:
    """Per class: accepted / reached forced tokens (decayed sums). `settings`: `policy.PolicyConfig`."""

    def __init__(self, settings):
        self.alpha = settings.alpha
        self._lock = threading.Lock()
        self._st: dict[str, list[float]] = {}  # class → [accepted, reached]

    def reset(self, replayed: Mapping[str, tuple[float, float]] | None = None) -> None:
        with self._lock:
            self._st.clear()

    def acceptance(self, workload: str) -> float:
        """Per-token acceptance of forced tokens in this class; PRIOR until 8 tokens were reached."""
        with self._lock:
            acc, n = self._st.get(workload, (0.0, 0.0))
        return acc / n if n >= 8 else PRIOR

    def gains(self, workload: str, m: int) -> tuple[float, ...]:
        """Expected accepted tokens for the first 1..m forced tokens: Σ_{i≤j} a^i (a token is reached
        only if the ones before it were accepted)."""
        a, out, p = self.acceptance(workload), [], 1.0
        for _ in range(m):
            p *= a
            out.append((out[-1] if out else 0.0) + p)
        return tuple(out)

    def observe(self, slot: Slot) -> None:
        """The tokens verification reached (accepted + the first rejected one), decayed by 1 − alpha."""
        reached = min(slot.k, slot.accepted + 1)
        if reached < 1:
            return
        with self._lock:
            st = self._st.setdefault(slot.workload, [0.0, 0.0])
            st[0] = (1 - self.alpha) * st[0] + slot.accepted
            st[1] = (1 - self.alpha) * st[1] + reached

    def report(self, workload: str) -> dict:
        return {"grammar_acceptance": round(self.acceptance(workload), 4)}

    def classes(self) -> set[str]:
        with self._lock:
            return set(self._st)


def _build(b: Build) -> GrammarProposer | None:
    """Off where the engine does not propose forced tokens (evaluation: τ measures the draft alone)."""
    return GrammarProposer(b.vocab_size, b.cfg.num_draft_tokens) if b.forced_tokens else None


SPEC = ProposerSpec(GrammarProposer, rung=3, estimator=GrammarEstimator, build=_build)
