"""EAGLE-2 draft-tree proposer for the EAGLE3 draft (greedy requests without logits transforms).

Source: EAGLE-2 (Li et al., arXiv 2406.16858) §3.1 expansion, §3.2 reranking, §4 (the draft's
confidence approximates acceptance: under the goodput policy the tree grows by value, `tree.widen`);
the tree maths are `engine.draft_tree`. The verify forward gives each node the cache and its ancestors
(SpecInfer, arXiv 2305.09781 §4.2); acceptance is `tree.accept_greedy` (in the engine's step).
"""
from __future__ import annotations

import functools

from ...config import tree_num_draft_tokens
from ..draft_tree import TreeJob, expand, layout, max_nodes, select, widen
from ..request import max_draft
from .base import Build, ProposerPolicy, ProposerSpec, Rung, Slot, by_draft
from .eagle3 import FIXED_RANK
from .eagle3_estimate import Eagle3Estimator


class Eagle3Tree:
    """EAGLE-2 trees of `slot.depth` draft forwards and `slot.n` verified nodes (up to `slot.cap`
    when widened); `topk` children per expanded node (SGLang's `--speculative-eagle-topk`), at most
    `nodes` drafted nodes per tree; depth at most `k` (num_draft_tokens, or the policy's k_max).
    Its kind is the chain's ("eagle3"): a tree is the EAGLE3 option of a tree request (same
    counters, same estimator, sized per node instead of per position)."""

    name = "eagle3"
    uses_draft = True
    gated = False

    def __init__(self, topk: int, nodes: int, k: int, max_seq_len: int):
        self.topk, self.nodes, self.k, self.max_seq_len = topk, nodes, k, max_seq_len

    def offer(self, sl: Slot, room: int, policy: ProposerPolicy | None) -> Rung | None:
        """n = 1..N−1 verified nodes (N = tree num_draft_tokens, capped by the KV and output room),
        depth min(depth, n, output room): under the policy its gains and width are the plan's; else
        the fixed tree of SGLang's knobs. Sets `sl.cap`."""
        s = sl.seq
        if not s.tree or room <= 0:
            return None
        steps = max_draft(policy, self.k, s.req)
        out_room = s.req.max_new_tokens - len(s.gen) - 1
        cap = min(self.nodes, max_nodes(min(steps, out_room), self.topk), self.max_seq_len - s.cache.length - 1)
        depth = tuple(min(steps, n, out_room) for n in range(1, cap + 1))
        sl.cap = cap
        est = policy.estimator(self.name) if policy is not None else None
        if sl.learn:
            return Rung(self.name, self, est.tree_gains(sl.workload, cap, lambda n: depth[n - 1]), drafts=True,
                        depth=depth, draft_rows=self.topk, catch_up_ms=policy.catch_up_ms(s))
        gain = est.tree_gains(sl.workload, cap, lambda n: depth[n - 1])[-1] if est else 0.0
        return Rung(self.name, self, drafts=True, depth=depth, draft_rows=self.topk, fixed=(FIXED_RANK, cap, gain))

    def propose(self, slots: list[Slot]) -> None:
        """Expand each request's tree to its depth (one batched draft forward per depth and draft),
        keep its `n` nodes of highest value (more while each still pays, under the policy's early
        stop), lay them out as verify rows (`slot.layout`, `slot.drafts` = its tokens after the root)
        and discard the tree's draft cache rows (the accepted path is next step's catch-up)."""
        for draft, group in by_draft(slots):
            for sl in group:
                sl.base = sl.seq.draft_cache.length
            jobs = [TreeJob(sl.hidden, sl.logits, sl.seq.draft_cache, sl.depth, self.topk) for sl in group]
            expand(draft, jobs)
            for sl, job in zip(group, jobs):
                nodes = select(job.tree, sl.n)
                if sl.stop_below > 0:  # EAGLE-2 value selection: more nodes while each still pays
                    accept = functools.partial(sl.estimator.accept_given_confidence, sl.workload)
                    nodes = widen(job.tree, nodes, accept, sl.stop_below, sl.cap)
                sl.layout = layout(job.tree, nodes, sl.seq.next_token)
                sl.drafts = sl.layout.tokens[1:]
                sl.seq.draft_cache.length = sl.base
                sl.draft_forwards, sl.draft_rows = sl.depth, self.topk

    def observe(self, slot: Slot) -> None:
        """Nothing to roll back: the tree's draft rows went at `propose`, the target's KV rows of the
        rejected nodes at acceptance (`KVCache.keep`)."""


def _build(b: Build) -> Eagle3Tree | None:
    """Trees only with eagle_topk > 1 (1: chains)."""
    c = b.cfg
    if c.tree.eagle_topk <= 1:
        return None
    n = tree_num_draft_tokens(c.num_draft_tokens, c.tree.eagle_topk, c.tree.num_draft_tokens)
    return Eagle3Tree(c.tree.eagle_topk, n - 1, c.num_draft_tokens, c.max_seq_len)


SPEC = ProposerSpec(Eagle3Tree, rung=1, estimator=Eagle3Estimator, build=_build)
