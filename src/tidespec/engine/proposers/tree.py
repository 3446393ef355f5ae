"""EAGLE-2 draft-tree proposer for the EAGLE3 draft (greedy requests without logits transforms).

Source: EAGLE-2 (Li et al., arXiv 2406.16858) §3.1 expansion, §3.2 reranking, §4 (the draft's
confidence approximates acceptance: under the goodput policy the tree grows by value, `tree.widen`);
the tree maths are `engine.tree`. The verify forward gives each node the cache and its ancestors
(SpecInfer, arXiv 2305.09781 §4.2); acceptance is `tree.accept_greedy` (in the engine's step).
"""
from __future__ import annotations

from ..tree import TreeJob, expand, layout, select, widen
from .base import Slot, by_draft


class Eagle3Tree:
    """EAGLE-2 trees of `slot.depth` draft forwards and `slot.n` verified nodes (up to `slot.cap`
    when widened); `topk` children per expanded node (SGLang's `--speculative-eagle-topk`).
    Its name is "eagle3": a tree is the EAGLE3 option of a tree request (same counters, same policy
    option, sized per node instead of per position)."""

    name = "eagle3"

    def __init__(self, topk: int):
        self.topk = topk

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
                    w, learn = sl.seq.req.workload, sl.learn
                    nodes = widen(job.tree, nodes, lambda c: learn.accept_given_confidence(w, c), sl.stop_below, sl.cap)
                sl.layout = layout(job.tree, nodes, sl.seq.next_token)
                sl.drafts = sl.layout.tokens[1:]
                sl.seq.draft_cache.length = sl.base
                sl.draft_forwards, sl.draft_rows = sl.depth, self.topk

    def observe(self, slot: Slot) -> None:
        """Teach the policy the accepted tokens of a tree of this size and depth (the target's KV
        rows of the rejected nodes were dropped at acceptance, `KVCache.keep`)."""
        if slot.learn is not None:
            slot.learn.observe_tree(slot.seq.req.workload, slot.k, slot.layout.max_depth, slot.accepted)
