"""EAGLE-2 dynamic draft trees for the EAGLE3 draft: expansion, reranking, the verify layout and
greedy acceptance.

EAGLE-2 (Li et al., arXiv 2406.16858) §3.1: each depth expands the `topk` nodes of highest
cumulative draft probability, `topk` children each; §3.2: the `num_draft_tokens − 1` nodes of
highest value are verified (a tree). The knobs are SGLang's, so the same numbers deploy there. The
verify forward is one target forward with a tree attention mask (SpecInfer, arXiv 2305.09781 §4.2).
Greedy only: the accepted path is the longest of target-argmax tokens, so the output is the
target-only output; sampled requests draft chains. More: docs/design/engine.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..models.runner import DraftCache, DraftRunner


@dataclass
class DraftTree:
    """One request's drafted tree. Node i: target token id, parent node (-1: the root, i.e. the
    last verified token), cumulative draft log-probability (value), depth (1 = a child of the root)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)

    def add(self, token: int, parent: int, score: float) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.scores.append(score)
        self.depth.append(1 if parent < 0 else self.depth[parent] + 1)
        return len(self.tokens) - 1


@dataclass
class Layout:
    """A selected tree as verify rows: row 0 is the root (the last verified token), rows 1..n the
    kept nodes, parents first. parent[i]: row of row i's parent (-1 for the root); tokens[i]: the
    token fed at row i (tokens[0] is filled by the caller); visible `[n+1, n+1]` bool (ancestors
    and self); depth `[n+1]` int64."""

    tokens: list[int]
    parent: list[int]
    visible: torch.Tensor
    depth: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return len(self.parent) - 1

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if self.num_nodes else 0


def select(tree: DraftTree, budget: int) -> list[int]:
    """The `budget` nodes of highest value (ties: the shallower first, so a parent precedes a child
    of equal value), in verify order (by depth, then value). Ancestor-closed: a node's value is its
    parent's plus a log-probability ≤ 0."""
    order = sorted(range(len(tree.tokens)), key=lambda i: (-tree.scores[i], tree.depth[i], i))[:max(budget, 0)]
    keep = set(order)
    if any(tree.parents[i] >= 0 and tree.parents[i] not in keep for i in keep):
        raise AssertionError("tree selection is not ancestor-closed")  # unreachable: values are non-increasing
    return sorted(order, key=lambda i: (tree.depth[i], -tree.scores[i], i))


def widen(tree: DraftTree, nodes: list[int], accept_given_conf, threshold: float, cap: int) -> list[int]:
    """`nodes` plus the nodes whose estimated probability of being reached and accepted — the
    product along their path of `accept_given_conf(draft probability of the node)` (EAGLE-2 §4: the
    draft's confidence approximates acceptance; calibrated per class by the policy) — is at least
    `threshold` (the step's break-even per verify row), highest value first, at most `cap` in all.
    Ancestor-closed: the estimate never grows along a path. Returns them in verify order."""
    reach: list[float] = []
    for i, p in enumerate(tree.parents):  # parents precede children in a DraftTree
        prev = 0.0 if p < 0 else tree.scores[p]
        reach.append((1.0 if p < 0 else reach[p]) * accept_given_conf(math.exp(tree.scores[i] - prev)))
    keep = set(nodes)
    for i in sorted(range(len(tree.tokens)), key=lambda i: (-tree.scores[i], tree.depth[i], i)):
        if len(keep) >= cap:
            break
        if i not in keep and reach[i] >= threshold and (tree.parents[i] < 0 or tree.parents[i] in keep):
            keep.add(i)
    return sorted(keep, key=lambda i: (tree.depth[i], -tree.scores[i], i))


def layout(tree: DraftTree, nodes: list[int], root_token: int) -> Layout:
    """Verify rows for `nodes` (from `select`): row r+1 is nodes[r]."""
    row = {nd: r + 1 for r, nd in enumerate(nodes)}
    n = len(nodes) + 1
    parent = [-1] + [row.get(tree.parents[nd], 0) for nd in nodes]
    vis = torch.zeros(n, n, dtype=torch.bool)
    vis[0, 0] = True
    for r in range(1, n):
        vis[r] = vis[parent[r]]
        vis[r, r] = True
    depth = torch.tensor([0] + [tree.depth[nd] for nd in nodes], dtype=torch.int64)
    return Layout([root_token] + [tree.tokens[nd] for nd in nodes], parent, vis, depth)


def accept_greedy(lay: Layout, preds: list[int]) -> list[int]:
    """Rows of the accepted path (root excluded): from the root, move to the child whose token is
    the target's argmax at the current row (`preds[row]`), while there is one."""
    children: dict[int, dict[int, int]] = {}
    for r in range(1, len(lay.parent)):
        children.setdefault(lay.parent[r], {})[lay.tokens[r]] = r
    path, cur = [], 0
    while (nxt := children.get(cur, {}).get(preds[cur])) is not None:
        path.append(nxt)
        cur = nxt
    return path


@dataclass
class TreeJob:
    """One request's expansion: the draft's chain start (hidden `[1, H]`, logits `[Vd]` after the
    catch-up over the verified rows), its cache (tree rows are appended after `cache.length` and
    discarded by the caller), the depth to draft (num_steps) and topk."""

    hidden: torch.Tensor
    logits: torch.Tensor
    cache: DraftCache
    depth: int
    topk: int
    tree: DraftTree = field(default_factory=DraftTree)


def expand(runner: DraftRunner, jobs: list[TreeJob]) -> None:
    """EAGLE-2 expansion (§3.1) for several requests on one draft, one batched draft forward per
    depth: depth 1 is the root's `topk` children; at depth d the `topk` nodes of highest value are
    fed (their rows see the prefix and their fed ancestors) and each drafts `topk` children. Fills
    `job.tree`; appends (depth − 1) · topk rows to each cache (the caller resets its length)."""
    state = []
    for j in jobs:
        base = j.cache.length
        lp = torch.log_softmax(j.logits.float(), -1)
        top = lp.topk(min(j.topk, lp.shape[0]))
        ids = runner.to_target_ids(top.indices).tolist()
        front = [j.tree.add(t, -1, float(v)) for t, v in zip(ids, top.values.tolist())]
        # per node: (hidden its row reads, cache row relative to base once fed)
        state.append(dict(base=base, front=front, src={nd: j.hidden for nd in front}, row={}))
    for d in range(1, max((j.depth for j in jobs), default=0)):
        act = [(j, st) for j, st in zip(jobs, state) if j.depth > d and st["front"]]
        if not act:
            break
        items = []
        for j, st in act:
            fed = j.cache.length - st["base"]
            m = len(st["front"])
            vis = torch.zeros(m, j.cache.length + m, dtype=torch.bool)
            vis[:, :st["base"]] = True
            for r, nd in enumerate(st["front"]):
                a = j.tree.parents[nd]
                while a >= 0:
                    vis[r, st["base"] + st["row"][a]] = True
                    a = j.tree.parents[a]
                vis[r, j.cache.length + r] = True
                st["row"][nd] = fed + r
            pos = torch.full((m,), st["base"] + d - 1, dtype=torch.int64)
            items.append((torch.cat([st["src"][nd] for nd in st["front"]]),
                          torch.tensor([j.tree.tokens[nd] for nd in st["front"]]), j.cache, vis, pos))
        for (j, st), (h, logits) in zip(act, runner.tree_step_batch(items)):
            lp = torch.log_softmax(logits.float(), -1)
            top = lp.topk(min(j.topk, lp.shape[-1]), dim=-1)
            ids = runner.to_target_ids(top.indices)
            cand = []
            for r, nd in enumerate(st["front"]):
                for t, v in zip(ids[r].tolist(), top.values[r].tolist()):
                    c = j.tree.add(t, nd, j.tree.scores[nd] + v)
                    st["src"][c] = h[r:r + 1]
                    cand.append(c)
            st["front"] = sorted(cand, key=lambda c: -j.tree.scores[c])[:j.topk]


def max_nodes(depth: int, topk: int) -> int:
    """Nodes an expansion of this depth and topk drafts: topk + (depth − 1) · topk²."""
    return topk + (depth - 1) * topk * topk if depth >= 1 else 0


__all__ = ["DraftTree", "Layout", "TreeJob", "select", "widen", "layout", "accept_greedy", "expand", "max_nodes"]
