"""Suffix proposer (SuffixDecoding, arXiv 2411.04975 §3–4): counts, matching, adaptive length,
frequency scores, eviction that leaves no trace."""
import pytest

from tidespec.engine.suffix_tree import SuffixCache, SuffixTrie


def brute_count(seqs, s):
    return sum(1 for q in seqs for i in range(len(q) - len(s) + 1) if q[i:i + len(s)] == s)


def node_of(trie, s):
    node = 0
    for t in s:
        node = trie._kids[node].get(t)
        if node is None:
            return None
    return node


def test_counts_equal_substring_occurrences_batch_and_incremental():
    seqs = [[1, 2, 3, 1, 2, 4, 1, 2, 3], [2, 3, 1, 2, 3, 3]]
    batch, inc = SuffixTrie(4), SuffixTrie(4)
    for q in seqs:
        batch.add(q)
        active = []
        for t in q:
            active = inc.extend(active, t)
    for s in ([1, 2], [1, 2, 3], [2, 3, 1, 2], [3], [3, 3], [4, 1, 2]):
        want = brute_count(seqs, s)
        assert batch._count[node_of(batch, s)] == want == inc._count[node_of(inc, s)], s
    assert node_of(batch, [1, 2, 3, 1, 2]) is None  # deeper than max_depth 4
    assert batch.num_nodes == inc.num_nodes


def test_removal_leaves_no_trace():
    t = SuffixTrie(5)
    t.add([7, 8, 9])
    before = (t.num_nodes, {k: v for k, v in t._kids[0].items()})
    t.add([1, 2, 7, 8, 1, 2, 3])
    t.add([1, 2, 7, 8, 1, 2, 3], -1)
    assert (t.num_nodes, t._kids[0]) == before
    with pytest.raises(ValueError):
        t.add([5, 5], -1)


def test_propose_follows_the_most_frequent_continuation_with_its_score():
    t = SuffixTrie(8)
    for _ in range(3):
        t.add([10, 11, 12, 13, 14])
    t.add([10, 11, 12, 99])
    p = t.propose([5, 10, 11, 12], max_spec=8, min_score=0.0, alpha=4.0)
    assert p.tokens == (13, 14) and p.score == pytest.approx(0.75) and p.match_len == 3
    assert t.propose([5, 10, 11, 12], max_spec=8, min_score=0.8, alpha=4.0).tokens == ()
    assert t.propose([10], max_spec=8, min_score=0.0, alpha=2.0).tokens == (11, 12)  # ⌈2 × 1⌉ tokens
    assert t.propose([77], max_spec=8, min_score=0.0, alpha=2.0).tokens == ()


def test_chain_continues_past_the_depth_bound():
    t = SuffixTrie(3)
    t.add(list(range(20)))
    assert t.propose([0, 1], max_spec=10, min_score=0.5, alpha=10.0).tokens == tuple(range(2, 12))


def test_request_tree_repeats_its_own_prompt_and_global_tree_learns_outputs():
    c = SuffixCache(max_depth=8, max_tokens=40, alpha=3.0, min_score=0.2)
    code = [1, 2, 3, 4, 5, 6]
    c.start("a", code + [9, 1, 2])
    p = c.propose("a")
    assert p.source == "request" and p.tokens[:4] == (3, 4, 5, 6)
    c.append("a", [3, 4])
    assert c.propose("a").tokens[:2] == (5, 6)
    c.finish("a", [3, 4, 5, 6, 42, 43, 44])
    c.start("b", [8, 8, 42])
    p = c.propose("b")
    assert p.source == "global" and p.tokens == (43, 44)
    for i in range(10):  # 10 × 7 tokens through a 40-token budget: the first output is evicted
        c.finish(f"x{i}", [100 + i] * 7)
    assert c.retained_tokens <= 40 and c.global_trie.propose([42], 4, 0.0, 4.0).tokens == ()


def test_random_inserts_and_evictions_match_brute_force_counts():
    import random
    rng = random.Random(0)
    t, kept = SuffixTrie(5), []
    for step in range(60):
        q = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        t.add(q)
        kept.append(q)
        if len(kept) > 6:
            t.add(kept.pop(0), -1)
        for _ in range(5):
            s = [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
            node = node_of(t, s)
            assert (t._count[node] if node is not None else 0) == brute_count(kept, s), (step, s)


def test_binary_search_match_equals_the_longest_continuing_suffix():
    """`match` searches the length by bisection (the predicate "occurs with a continuation" is
    monotone in the length); it must return what scanning every suffix, longest first, returns."""
    import random
    rng = random.Random(1)

    def scan(trie, ctx, max_len):
        ctx = ctx[-max_len:]
        for start in range(len(ctx)):
            node = node_of(trie, ctx[start:])
            if node is not None and trie._kids[node]:
                return node, len(ctx) - start
        return 0, 0

    t, kept = SuffixTrie(6), []
    for step in range(80):
        q = [rng.randrange(3) for _ in range(rng.randrange(1, 14))]
        t.add(q)
        kept.append(q)
        if len(kept) > 5:
            t.add(kept.pop(0), -1)
        for _ in range(6):
            ctx = [rng.randrange(3) for _ in range(rng.randrange(0, 12))]
            assert t.match(ctx, 5) == scan(t, ctx, 5), (step, ctx)


def test_request_tree_is_built_on_first_proposal_and_equals_the_incremental_one():
    """A request's own tree is built only when proposals are asked for (the policy may never ask; the
    first ones scan); built late, it must propose exactly what a tree extended token by token proposes."""
    import random

    from tidespec.engine.suffix_tree import OWN_TREE_AFTER
    rng = random.Random(2)
    for case in range(40):
        c = SuffixCache(max_depth=6, max_tokens=0, alpha=2.0, min_score=0.0)  # no global tree: own proposals only
        prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 20))]
        c.start("r", prompt)
        assert c._live["r"].trie is None  # nothing built before a proposal is asked for
        ref, active, seen = SuffixTrie(6), [], []
        for t in prompt:
            active = ref.extend(active, t)
        seen += prompt
        for step in range(rng.randrange(1, 12)):
            new = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
            c.append("r", new)
            for t in new:
                active = ref.extend(active, t)
            seen += new
            if rng.random() < 0.4:
                want = ref.propose(seen, c.max_spec, c.min_score, c.alpha)
                got = c.propose("r")
                assert (got.tokens, got.scores) == (want.tokens, want.scores), (case, step)
        for _ in range(OWN_TREE_AFTER):
            c.propose("r")
        assert c._live["r"].trie._count == ref._count and c._live["r"].active == active, case


def _random_cache(rng, max_tokens):
    cache = SuffixCache(max_depth=5, max_tokens=max_tokens)
    for _ in range(30):
        cache.insert([rng.randrange(4) for _ in range(rng.randrange(1, 12))])
    return cache.retained(), cache.global_trie


def _substrings(seqs, depth):
    return {tuple(q[i:j]) for q in seqs for i in range(len(q)) for j in range(i + 1, min(len(q), i + depth) + 1)}


def test_counts_match_brute_force_after_evictions():
    """Random outputs through a SuffixCache whose budget evicts (removal, then node reuse): every
    substring up to max_depth of the retained sequences is one node counting its occurrences."""
    import random
    seqs, trie = _random_cache(random.Random(7), max_tokens=40)
    subs = _substrings(seqs, 5)
    assert trie.num_nodes == len(subs) + 1
    for s in subs:
        assert trie._count[node_of(trie, list(s))] == brute_count(seqs, list(s)), s


def test_children_are_ordered_by_first_occurrence():
    """Without evictions a node's children are in the order their paths first end in the inserted
    sequences (`propose` breaks a tie in counts by this order)."""
    import random
    seqs, trie = _random_cache(random.Random(3), max_tokens=10_000)
    flat = [t for q in seqs for t in (*q, None)]  # None: no substring spans two sequences

    def first_end(path):
        return min(j for j in range(len(path) - 1, len(flat)) if flat[j - len(path) + 1:j + 1] == path)
    for s in [()] + sorted(x for x in _substrings(seqs, 4)):
        kids = list(trie._kids[node_of(trie, list(s))])
        assert kids == sorted(kids, key=lambda t: first_end([*s, t])), s


def test_evicted_nodes_are_reused():
    """A global tree that evicts as it inserts keeps its node table at the peak of live nodes: one
    10-token sequence (depth 5) has at most 10+9+8+7+6 = 40 substrings, two are live at most (the
    new one inserted before the old is evicted), so ≤ 80 nodes besides the root, however many pass."""
    import random
    rng = random.Random(1)
    cache = SuffixCache(max_depth=5, max_tokens=10)
    for _ in range(50):
        cache.insert([rng.randrange(50) for _ in range(10)])
    assert len(cache.global_trie._count) <= 81 and cache.retained_tokens == 10


def test_a_scan_proposes_what_the_requests_own_tree_proposes():
    """`scan_propose` (a request's first proposals, no tree) against the tree over the same context,
    the oracle: 2000 random contexts over small vocabularies (many ties and repeats), depths down to
    the bound 2 (re-matching every token), every knob — the same tokens, match length and scores."""
    import random

    import numpy as np

    from tidespec.engine.suffix_tree import scan_propose
    rng = random.Random(0)
    for _ in range(2000):
        ctx = [rng.randrange(rng.choice([2, 3, 5, 20])) for _ in range(rng.randrange(1, 80))]
        depth = rng.choice([2, 3, 5, 24])
        knobs = (rng.choice([1, 4, 16]), rng.choice([0.0, 0.1, 0.3]), rng.choice([0.5, 2.0, 4.0]))
        tree = SuffixTrie(depth)
        tree.add(ctx)
        want = tree.propose(ctx, *knobs)
        got = scan_propose(np.array(ctx, dtype=np.int64), ctx, depth, *knobs)
        assert (got.tokens, got.match_len) == (want.tokens, want.match_len), (ctx, depth, knobs)
        assert got.scores == pytest.approx(want.scores, abs=1e-12) and got.score == pytest.approx(want.score)


def test_the_own_tree_is_built_only_for_a_request_that_keeps_proposing():
    """A request's first OWN_TREE_AFTER − 1 proposals scan (no tree: a probe costs no build); the
    next builds the tree, which then follows every emitted token; the proposals never change."""
    from tidespec.engine.suffix_tree import OWN_TREE_AFTER
    cache = SuffixCache(max_depth=6, max_spec=4, alpha=4.0, min_score=0.0)
    ctx = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    cache.start("r", ctx)
    live = cache._live["r"]
    for i in range(1, OWN_TREE_AFTER + 2):
        p = cache.propose("r")
        assert (live.trie is not None) == (i >= OWN_TREE_AFTER), i
        tree = SuffixTrie(6)
        tree.add(live.tokens)
        assert p.tokens == tree.propose(live.tokens, 4, 0.0, 4.0).tokens and p.source == "request"
        cache.append("r", [p.tokens[0] if p.tokens else 9])
    assert live.trie._count[node_of(live.trie, [1, 2])] == brute_count([live.tokens], [1, 2])
