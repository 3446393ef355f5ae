"""Suffix proposer's data structure: suffix trees over the request's own tokens and over recently
served outputs (`SuffixCache`, `SuffixTrie`) — no draft model, no training.

SuffixDecoding (Oliaro et al., arXiv 2411.04975 §3–4): find the longest suffix of the context that
occurs in a tree of previous sequences and follow its most frequent continuation, each step scored
by its empirical conditional frequency; at most ⌈alpha × match length⌉ tokens (≤ `max_spec`),
stopping below `min_score`. Two trees (the request's own, the global one over recent outputs
within `max_tokens`); the higher-scoring proposal wins. A depth-bounded trie in pure Python, why not
ArcticInference's C++ tree, and costs: docs/design/engine.md.
"""
from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

CORPUS_FILE = "suffix_corpus.safetensors"  # beside a draft's model.safetensors: the global tree it deploys with


@dataclass(frozen=True)
class Proposal:
    """Speculated tokens, the chain's score (product of conditional frequencies, in [0, 1]), the
    length of the context suffix that matched, the tree it came from ("request", "global"), and
    the chain's score after each token (`scores[i]`: the estimated probability that tokens[:i+1]
    are all accepted; their sum is the expected number accepted)."""

    tokens: tuple[int, ...] = ()
    score: float = 0.0
    match_len: int = 0
    source: str = "none"
    scores: tuple[float, ...] = ()


class SuffixTrie:
    """Depth-bounded suffix trie over token sequences with occurrence counts.

    Every substring of length ≤ `max_depth` of every inserted sequence is a path from the root;
    a node's count is the number of its occurrences. Node 0 is the root. Raises ValueError for
    max_depth < 2.
    """

    def __init__(self, max_depth: int = 24):
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self._kids: list[dict[int, int]] = [{}]
        self._count: list[int] = [0]
        self._free: list[int] = []

    @property
    def num_nodes(self) -> int:
        """Nodes in use, root included."""
        return len(self._count) - len(self._free)

    def _bump(self, parent: int, token: int, delta: int) -> int:
        """Add `delta` to the count of child `token` of `parent` (created / freed as needed)."""
        kids = self._kids[parent]
        node = kids.get(token)
        if node is None:
            if delta <= 0:
                raise ValueError("removing a sequence that was never inserted")
            if self._free:
                node = self._free.pop()
                self._kids[node] = {}  # a freed node's children reached 0 with it (count(s+t) ≤ count(s))
            else:
                node = len(self._count)
                self._count.append(0)
                self._kids.append({})
            kids[token] = node
        self._count[node] += delta
        if self._count[node] <= 0:
            del kids[token]
            self._count[node] = 0
            self._free.append(node)  # its children are decremented by the same removal walk
        return node

    def add(self, tokens: list[int], delta: int = 1) -> None:
        """Insert (delta 1) or remove (delta -1, a sequence inserted before) every substring of
        `tokens` up to max_depth long (an insertion runs `extend` per token: the same substrings, in
        the same order of first occurrence, so the same trie)."""
        if delta == 1:
            active: list[int] = []
            for t in tokens:
                active = self.extend(active, t)
            return
        for i in range(len(tokens)):
            node = 0
            for t in tokens[i:i + self.max_depth]:
                node = self._bump(node, t, delta)

    def extend(self, active: list[int], token: int) -> list[int]:
        """Append `token` to a sequence inserted incrementally. `active`: the nodes of the suffixes
        ending at the previous token, shortest first (start with []); returns the new ones. O(max_depth).
        `_bump(parent, token, 1)` for the root and each active node, inlined: a request's own tree is
        built with this per token of its context (max_depth calls a token), the hot path of a probe."""
        kids_of, count, free = self._kids, self._count, self._free
        out = []
        for parent in (0, *active[:self.max_depth - 1]):
            kids = kids_of[parent]
            node = kids.get(token)
            if node is None:
                if free:
                    node = free.pop()
                    kids_of[node] = {}
                else:
                    node = len(count)
                    count.append(0)
                    kids_of.append({})
                kids[token] = node
            count[node] += 1
            out.append(node)
        return out

    def match(self, context: list[int], max_len: int) -> tuple[int, int]:
        """(node, length) of the longest suffix of `context`, at most `max_len` tokens, that occurs
        in the trie with a continuation (a node with children: an occurrence at the very end of a
        sequence — e.g. the context itself in the request's own tree — predicts nothing); (0, 0)
        when there is none. Binary search over the length, O(max_len · log max_len) lookups: every
        substring of an inserted sequence is a path, so if the suffix of length m occurs with a
        continuation, so does every shorter one (the predicate is monotone in m)."""
        ctx = context[-max_len:] if max_len else []
        lo, hi, best = 1, len(ctx), (0, 0)  # invariant: lengths < lo continue, lengths > hi do not
        while lo <= hi:
            m = (lo + hi) // 2
            node = self._walk(ctx[-m:])
            if node > 0 and self._kids[node]:
                best, lo = (node, m), m + 1
            else:
                hi = m - 1
        return best

    def _walk(self, tokens: list[int]) -> int:
        """The node of the path `tokens` from the root, -1 when it is not in the trie."""
        node = 0
        for t in tokens:
            node = self._kids[node].get(t, -1)
            if node < 0:
                return -1
        return node

    def propose(self, context: list[int], max_spec: int, min_score: float, alpha: float) -> Proposal:
        """The most frequent continuation of `context` (see the module docstring)."""
        node, m = self.match(context, self.max_depth - 1)
        if m == 0:
            return Proposal()
        budget = min(max_spec, math.ceil(alpha * m))
        ctx, toks, score, scores = list(context), [], 1.0, []
        while len(toks) < budget:
            kids = self._kids[node]
            if not kids:  # at the depth bound or a sequence's end: continue from the longest tail that continues
                node, m2 = self.match(ctx, self.max_depth - 1)
                if not m2:
                    break
                kids = self._kids[node]
            t, child = max(kids.items(), key=lambda kv: self._count[kv[1]])
            total = sum(self._count[c] for c in kids.values())  # occurrences that continued
            s = score * self._count[child] / total
            if s < min_score:
                break
            toks.append(t)
            scores.append(s)
            ctx.append(t)
            node, score = child, s
        return Proposal(tuple(toks), score if toks else 0.0, m, scores=tuple(scores))


OWN_TREE_AFTER = 8  # a request's first proposals scan its context (`scan_propose`); then its own tree is built


def _scan_match(a: np.ndarray, query: list[int], max_len: int) -> tuple[int, np.ndarray]:
    """(m, ends): the longest suffix of `query`, at most `max_len` tokens, that occurs in `a` with a
    continuation (ending before a's last token), and the positions its occurrences end at
    (ascending); (0, empty) when there is none. One vectorised filter per matched length."""
    lim = min(max_len, len(query))
    if a.shape[0] < 2 or lim < 1:
        return 0, a[:0]
    ends = np.flatnonzero(a[:-1] == query[-1])
    m = 1 if ends.size else 0
    while 0 < m < lim:
        e = ends[ends >= m]
        e = e[a[e - m] == query[-1 - m]]
        if e.size == 0:
            break
        ends, m = e, m + 1
    return m, ends


def scan_propose(a: np.ndarray, context: list[int], max_depth: int, max_spec: int, min_score: float,
                 alpha: float) -> Proposal:
    """`SuffixTrie.propose` over the suffix trie of the one sequence `a` (`[L]` int64), computed
    from `a`'s occurrences instead of a built tree: the same proposal (a path's count is its number
    of occurrences; children tie by first occurrence, as the tree's insertion order), no O(L ·
    max_depth) build. A request whose proposals the policy only probes pays for a scan, not a tree."""
    last = a.shape[0] - 1
    m, ends = _scan_match(a, context, max_depth - 1)
    if m == 0:
        return Proposal()
    budget = min(max_spec, math.ceil(alpha * m))
    ctx, toks, score, scores, depth = list(context), [], 1.0, [], m
    while len(toks) < budget:
        cont = ends[ends < last] if depth < max_depth else ends[:0]  # occurrences with a child
        if cont.size == 0:  # at the depth bound or the sequence's end: re-match the longest tail
            depth, cont = _scan_match(a, ctx, max_depth - 1)
            if not depth:
                break
        nxt = a[cont + 1]
        kids, first, counts = np.unique(nxt, return_index=True, return_counts=True)
        i = max(range(len(kids)), key=lambda j: (counts[j], -first[j]))
        s = score * int(counts[i]) / cont.size
        if s < min_score:
            break
        t = int(kids[i])
        toks.append(t)
        scores.append(s)
        ctx.append(t)
        ends, score, depth = cont[nxt == t] + 1, s, depth + 1
    return Proposal(tuple(toks), score if toks else 0.0, m, scores=tuple(scores))


@dataclass
class _Live:
    """A running request's context and its own tree, built at its `OWN_TREE_AFTER`-th proposal (the
    first ones scan the context: a request whose proposals the policy only probes never pays for
    a tree; one proposing every step soon amortises it: a tree proposes in ~8 µs, a scan ~50 µs)."""

    tokens: list[int]
    trie: SuffixTrie | None = None
    active: list[int] | None = None
    asked: int = 0

    def propose(self, max_depth: int, max_spec: int, min_score: float, alpha: float) -> Proposal:
        self.asked += 1
        if self.trie is None and self.asked < OWN_TREE_AFTER:
            return scan_propose(np.asarray(self.tokens, dtype=np.int64), self.tokens, max_depth, max_spec,
                                min_score, alpha)
        return self.own_trie(max_depth).propose(self.tokens, max_spec, min_score, alpha)

    def own_trie(self, max_depth: int) -> SuffixTrie:
        if self.trie is None:
            self.trie, self.active = SuffixTrie(max_depth), []
            for t in self.tokens:
                self.active = self.trie.extend(self.active, t)
        return self.trie


class SuffixCache:
    """The request trees and the global tree of one engine (`engine.proposers.suffix` drafts from its proposals).

    max_depth: trie depth (tokens); max_tokens: the global tree's budget in tokens of retained
    outputs (oldest evicted first); max_spec: most tokens per proposal; alpha: tokens per matched
    token (SuffixDecoding's adaptive length); min_score: a chain stops below this score. Raises
    ValueError for bad values.
    """

    def __init__(self, max_depth: int = 24, max_tokens: int = 50_000, max_spec: int = 16, alpha: float = 2.0,
                 min_score: float = 0.1):
        if max_tokens < 0 or max_spec < 1 or alpha <= 0 or not 0 <= min_score <= 1:
            raise ValueError("SuffixCache needs max_tokens >= 0, max_spec >= 1, alpha > 0, 0 <= min_score <= 1")
        self.max_depth, self.max_tokens, self.max_spec = max_depth, max_tokens, max_spec
        self.alpha, self.min_score = alpha, min_score
        self.global_trie = SuffixTrie(max_depth)
        self._retained: deque[list[int]] = deque()
        self._retained_tokens = 0
        self._live: dict[str, _Live] = {}
        self._staged: tuple[SuffixTrie, deque, int] | None = None  # a global tree waiting for the next step
        self._stage_lock = threading.Lock()

    def start(self, request_id: str, prompt: list[int]) -> None:
        """Open the request's context with its prompt (its first proposals scan it; its tree is built
        at the `OWN_TREE_AFTER`-th)."""
        self._live[request_id] = _Live([int(t) for t in prompt])

    def append(self, request_id: str, tokens: list[int]) -> None:
        """Extend the request's context (and its tree, once built) with emitted tokens."""
        live = self._live[request_id]
        new = [int(t) for t in tokens]
        if live.trie is not None:
            for t in new:
                live.active = live.trie.extend(live.active, t)
        live.tokens += new

    def propose(self, request_id: str) -> Proposal:
        """The better proposal (more expected accepted tokens: the sum of its chain scores) of the
        request's tree and the global tree for the request's context so far."""
        live = self._live[request_id]
        own = self._own(live)
        glob = self.global_trie.propose(live.tokens, self.max_spec, self.min_score, self.alpha)
        glob = Proposal(glob.tokens, glob.score, glob.match_len, "global", glob.scores)
        return max((own, glob), key=lambda p: (sum(p.scores), p.score))

    def _own(self, live: _Live) -> Proposal:
        p = live.propose(self.max_depth, self.max_spec, self.min_score, self.alpha)
        return Proposal(p.tokens, p.score, p.match_len, "request", p.scores)

    def finish(self, request_id: str, output: list[int] | None = None) -> None:
        """Close the request's tree; `output` (its generated tokens) joins the global tree, the
        oldest retained outputs are evicted while over max_tokens."""
        self._live.pop(request_id, None)
        if output:
            self.insert(list(output))

    def build_global(self, seqs: list[list[int]]) -> tuple[SuffixTrie, deque, int]:
        """A global tree over `seqs` (oldest first; the newest kept within max_tokens), built apart
        from the live one so serving is not held while it is built; `install_global` swaps it in."""
        keep = newest_within([[int(t) for t in seq] for seq in seqs], self.max_tokens)
        trie = SuffixTrie(self.max_depth)
        for seq in keep:
            trie.add(seq)
        return trie, deque(keep), sum(len(x) for x in keep)

    def install_global(self, built: tuple[SuffixTrie, deque, int]) -> None:
        """Replace the global tree with one from `build_global` (call between engine steps)."""
        self.global_trie, self._retained, self._retained_tokens = built

    def stage_global(self, seqs: list[list[int]], vocab_size: int) -> int:
        """Build a global tree over `seqs` (`build_global`) to be installed by `install_staged`, the
        next time the engine is between steps. Returns the tokens it retains. Raises ValueError for
        a token id outside [0, vocab_size) (a corpus built for another target), staging nothing."""
        bad = next((t for seq in seqs for t in seq if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"suffix corpus token id {bad} outside the target vocabulary [0, {vocab_size}); "
                             "it was built for another target: rebuild it with the cycle")
        built = self.build_global(seqs)
        with self._stage_lock:
            self._staged = built
        return built[2]

    def install_staged(self) -> None:
        """Install a staged global tree, if any (call between engine steps)."""
        with self._stage_lock:
            built, self._staged = self._staged, None
        if built is not None:
            self.install_global(built)

    def insert(self, tokens: list[int]) -> None:
        """Add a finished output to the global tree (cycle rebuilds call this for the curated window)."""
        if not tokens or self.max_tokens == 0:
            return
        self.global_trie.add(tokens)
        self._retained.append(tokens)
        self._retained_tokens += len(tokens)
        while self._retained_tokens > self.max_tokens and self._retained:
            old = self._retained.popleft()
            self.global_trie.add(old, -1)
            self._retained_tokens -= len(old)

    @property
    def retained_tokens(self) -> int:
        return self._retained_tokens

    def retained(self) -> list[list[int]]:
        """Copies of the sequences the global tree holds, oldest first (`Engine.set_suffix_corpus`
        restores them)."""
        return [list(x) for x in self._retained]


def newest_within(seqs: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The newest non-empty sequences of `seqs` (oldest first) whose lengths add up to at most
    `max_tokens` tokens, oldest first (a sequence that does not fit is skipped, older ones may fit)."""
    keep, n = [], 0
    for seq in reversed(seqs):
        if seq and n + len(seq) <= max_tokens:
            keep.append(seq)
            n += len(seq)
    return keep[::-1]


def save_corpus(path: Path, seqs: list[list[int]]) -> dict[str, int]:
    """Write token sequences for a global tree (`CORPUS_FILE` format: safetensors with `tokens`
    `[N]` int32 and `offsets` `[n+1]` int64, sequence i = tokens[offsets[i]:offsets[i+1]]; metadata
    sequences/tokens). Returns {"sequences", "tokens"}."""
    lens = [len(s) for s in seqs]
    offsets = torch.zeros(len(seqs) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0) if seqs else offsets[1:]
    tokens = torch.tensor([t for s in seqs for t in s], dtype=torch.int32)
    info = {"sequences": len(seqs), "tokens": int(tokens.numel())}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_suffix(".tmp")
    save_file({"tokens": tokens, "offsets": offsets}, str(tmp), metadata={k: str(v) for k, v in info.items()})
    tmp.replace(path)
    return info


def corpus_info(path: Path) -> dict[str, int]:
    """{"sequences", "tokens"} from a corpus file's header (nothing else read). Raises ValueError
    for a file that is not a suffix corpus."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        return {"sequences": int(meta["sequences"]), "tokens": int(meta["tokens"])}
    except (KeyError, ValueError, OSError, RuntimeError, SafetensorError) as e:
        raise ValueError(f"{path}: not a suffix corpus ({type(e).__name__}: {e}); delete it or rebuild it "
                         "with the cycle (train step)") from None


def load_corpus(path: Path) -> list[list[int]]:
    """The token sequences of a corpus file (`save_corpus`). Raises ValueError for a malformed file."""
    try:
        t = load_file(str(path))
        tokens, offsets = t["tokens"], t["offsets"]
    except (KeyError, OSError, RuntimeError, ValueError, SafetensorError) as e:
        raise ValueError(f"{path}: not a suffix corpus ({type(e).__name__}: {e}); delete it or rebuild it "
                         "with the cycle (train step)") from None
    if offsets.ndim != 1 or offsets.numel() < 1 or int(offsets[0]) != 0 or int(offsets[-1]) != tokens.numel() \
            or bool((offsets[1:] < offsets[:-1]).any()) or tokens.dtype != torch.int32:
        raise ValueError(f"{path}: suffix corpus offsets do not index its tokens; rebuild it with the cycle")
    ids, off = tokens.tolist(), offsets.tolist()
    return [ids[a:b] for a, b in zip(off, off[1:])]
