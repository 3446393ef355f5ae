"""EAGLE-2 draft trees: the tree-masked target forward equals running each path alone, KV compaction
keeps the accepted path, expansion follows the draft's own chain along every path, rerank keeps an
ancestor-closed tree, and the engine's tree decoding is the target-only output (greedy)."""
from collections import Counter

import pytest
import torch

from conftest import ladder, random_draft
from tidespec.config import EngineParams, tree_num_draft_tokens
from tidespec.engine.calibration import Calibration
from tidespec.engine.draft_tree import DraftTree, TreeJob, accept_greedy, expand, layout, max_nodes, select, widen
from tidespec.engine.policy import GoodputPolicy, StepCost, draft_batches, goodput
from tidespec.engine.policy.search import _Step, best_alone, step_draft_batches
from tidespec.engine.sampling import SamplingParams
from tidespec.engine.speculative import Engine, Request
from tidespec.models.runner import DraftRunner
from tidespec.models.target import Segment


def _tree() -> DraftTree:
    """root ─ a(5) ─ c(7) ─ e(9)
              │    └ d(8)
              └ b(6) ─ f(7)"""
    t = DraftTree()
    a = t.add(5, -1, -0.1)
    b = t.add(6, -1, -1.0)
    c = t.add(7, a, -0.3)
    t.add(8, a, -2.0)
    t.add(9, c, -0.5)
    t.add(7, b, -1.2)
    return t


def test_select_keeps_the_best_nodes_parents_first_and_accept_walks_the_argmax():
    t = _tree()
    assert select(t, 4) == [0, 1, 2, 4]  # values -0.1, -1.0 (depth 1), -0.3 (depth 2), -0.5 (depth 3)
    assert select(t, 10) == [0, 1, 2, 5, 3, 4]
    lay = layout(t, select(t, 4), root_token=3)
    assert lay.tokens == [3, 5, 6, 7, 9] and lay.parent == [-1, 0, 0, 1, 3]
    assert lay.depth.tolist() == [0, 1, 1, 2, 3] and lay.max_depth == 3
    assert lay.visible.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0],
                                          [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]]
    # target argmax per row: root → 5 (row 1), row 1 → 7 (row 3), row 3 → 4 (no such child)
    assert accept_greedy(lay, [5, 7, 0, 4, 0]) == [1, 3]
    assert accept_greedy(lay, [6, 0, 1, 0, 0]) == [2]  # the second branch
    assert accept_greedy(lay, [1, 0, 0, 0, 0]) == []
    assert max_nodes(3, 4) == 4 + 2 * 16 and max_nodes(1, 2) == 2


def test_tree_forward_equals_each_path_alone_and_keep_compacts_the_cache(tiny_target):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 320, (11,), generator=g)
    t = DraftTree()
    for tok, par, sc in [(40, -1, -.1), (41, -1, -.2), (42, 0, -.3), (43, 0, -.4), (44, 2, -.5), (45, 1, -.6)]:
        t.add(tok, par, sc)
    lay = layout(t, select(t, 6), root_token=30)
    cache = tiny_target.new_cache(64)
    tiny_target.forward(prompt, cache)
    out = tiny_target.forward_batch([Segment(torch.tensor(lay.tokens), cache, tree=(lay.visible, lay.depth))])[0]
    for r in range(len(lay.tokens)):
        path, x = [], r
        while x >= 0:
            path.append(lay.tokens[x])
            x = lay.parent[x]
        ref_cache = tiny_target.new_cache(64)
        ref = tiny_target.forward(torch.cat([prompt, torch.tensor(path[::-1])]), ref_cache)
        torch.testing.assert_close(out.logits[r], ref.logits[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.aux[r], ref.aux[-1], atol=1e-4, rtol=1e-4)
    # keep the path root → 41 → 45 (rows 0, 2, 6), then decode on: equals the sequence run alone
    rows = [0, lay.tokens.index(41), lay.tokens.index(45)]
    cache.keep(len(prompt), rows)
    assert cache.length == len(prompt) + 3
    nxt = tiny_target.forward(torch.tensor([50, 51]), cache)
    ref_cache = tiny_target.new_cache(64)
    ref = tiny_target.forward(torch.cat([prompt, torch.tensor([30, 41, 45, 50, 51])]), ref_cache)
    torch.testing.assert_close(nxt.logits, ref.logits[-2:], atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="increasing"):
        cache.keep(0, [2, 1])


def test_expansion_drafts_each_nodes_children_from_its_own_path(tiny_target):
    runner = DraftRunner(random_draft(tiny_target, 64, seed=3))
    prompt = torch.randint(3, 320, (9,), generator=torch.Generator().manual_seed(1))
    cache = tiny_target.new_cache(64)
    out = tiny_target.forward(prompt, cache)
    dcache = runner.new_cache(64)
    h, lg = runner.extend_batch([(out.aux, torch.cat([prompt[1:], torch.tensor([7])]), dcache)])[0]
    snapshot = (dcache.k.clone(), dcache.v.clone(), dcache.length)
    job = TreeJob(h, lg, dcache, depth=3, topk=3)
    expand(runner, [job])
    t = job.tree
    assert len(t.tokens) == max_nodes(3, 3) and max(t.depth) == 3
    assert dcache.length == snapshot[2] + 2 * 3  # (depth - 1) · topk rows appended
    # a node's children are the draft's top-3 after running the draft chain along its path alone
    children: dict[int, list[int]] = {}
    for i, p in enumerate(t.parents):
        children.setdefault(p, []).append(i)
    assert [t.tokens[i] for i in children[-1]] == runner.to_target_ids(lg.topk(3).indices).tolist()
    fed = [nd for nd in children if nd >= 0]
    assert len(fed) == 2 * 3  # depth 1 and depth 2 frontiers
    for nd in fed:
        path, x = [], nd
        while x >= 0:
            path.append(x)
            x = t.parents[x]
        c2 = runner.new_cache(64)
        c2.k, c2.v, c2.length = snapshot[0].clone(), snapshot[1].clone(), snapshot[2]
        hh = h
        for x in path[::-1]:
            hh, logits = runner.step(hh, torch.tensor([t.tokens[x]]), c2)
        want = runner.to_target_ids(logits[0].topk(3).indices).tolist()
        assert [t.tokens[i] for i in children[nd]] == want
        for i in children[nd]:  # values: the parent's plus the child's log-probability
            lp = torch.log_softmax(logits[0], -1)
            d = int((runner.used == t.tokens[i]).nonzero())
            assert t.scores[i] == pytest.approx(t.scores[nd] + float(lp[d]), abs=1e-4)


@pytest.mark.parametrize("topk,n", [(2, None), (3, 7), (4, 13)])
def test_tree_decoding_equals_target_only(tiny_target, topk, n):
    g = torch.Generator().manual_seed(topk)
    prompts = [torch.randint(3, 320, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
               for _ in range(4)]
    lp = SamplingParams(logprobs=3)  # values, not only argmaxes: a wrong mask or position changes them
    ref = [
        Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256)).generate(
            p, 40, capture=True, sampling=lp
        )
        for p in prompts
    ]
    # a random draft over the 12 tokens the target emits most: some paths get accepted
    runner = DraftRunner(random_draft(tiny_target, 12, counts=Counter(t for r in ref for t in r.tokens), seed=topk))
    eng = Engine(
        tiny_target,
        runner,
        EngineParams(num_draft_tokens=3, max_seq_len=256, tree={"eagle_topk": topk, "num_draft_tokens": n}),
    )
    alone = [eng.generate(p, 40, capture=True, sampling=lp) for p in prompts]
    batch = eng.generate_batch([Request(p, 40, capture=True, sampling=lp) for p in prompts])
    nodes = (n or 1 + 3 * topk) - 1
    for a, b, c in zip(ref, alone, batch):
        assert a.tokens == b.tokens == c.tokens
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert b.stats.num_drafts > 0
        assert b.stats.num_draft_tokens <= nodes * b.stats.num_drafts
        assert len(b.stats.num_accepted_tokens_per_pos) <= 3  # per position = per depth
        for key in ("input_ids", "loss_mask"):
            assert torch.equal(a.record[key], b.record[key])
        torch.testing.assert_close(a.record["aux_hidden_states"], b.record["aux_hidden_states"], atol=1e-4, rtol=1e-4)
    # trees verify more nodes than a chain of depth 3, and the paths accepted reach past depth 1
    assert max(x.stats.num_draft_tokens / x.stats.num_drafts for x in alone) > 3
    assert sum(x.stats.num_accepted_tokens for x in alone) > 0


def test_sampled_and_processed_requests_draft_chains(tiny_target):
    runner = DraftRunner(random_draft(tiny_target, 64, seed=1))
    eng = Engine(tiny_target, runner, EngineParams(num_draft_tokens=3, max_seq_len=256, tree={"eagle_topk": 3}))
    s = eng.generate([5, 6, 7], 24, sampling=SamplingParams(temperature=0.8, seed=1))
    assert s.stats.num_draft_tokens == 3 * s.stats.num_drafts  # a chain of k = 3 every step
    p = eng.generate([5, 6, 7], 24, sampling=SamplingParams(repetition_penalty=1.3))
    assert p.stats.num_draft_tokens == 3 * p.stats.num_drafts
    ref = Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256)).generate(
        [5, 6, 7], 24, sampling=SamplingParams(repetition_penalty=1.3)
    )
    assert p.tokens == ref.tokens


def test_tree_under_the_goodput_policy_is_lossless_and_sizes_the_tree(tiny_target):
    cal = Calibration((10.0, 10.5, 11.0, 11.5), 1.0, "test", 128, (1, 4), (1, 2, 3, 4, 8),
                      ((10.0, 10.5, 11.0, 11.5, 13.0), (20.0, 40.0, 60.0, 80.0, 160.0)), (1.0, 2.0))
    pol = GoodputPolicy(cal, prior=0.9, probe_every=4)
    runner = DraftRunner(random_draft(tiny_target, 64, seed=2))
    eng = _tree_engine(tiny_target, runner, pol)
    ref = Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256))
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    outs = eng.generate_batch([Request(p, 32, workload="code") for p in prompts])
    for p, o in zip(prompts, outs):
        assert o.tokens == ref.generate(p, 32).tokens
    assert pol.estimator("eagle3").report("code")["accepted_by_tree_size"], "it learned accepted tokens per tree size"
    gains = pol.estimator("eagle3").tree_gains("code", 6, lambda n: min(3, n))
    assert len(gains) == 6 and all(b >= a for a, b in zip(gains, gains[1:]))


def test_tree_costs_in_the_plan():
    chain, tree = ladder((0.5, 0.8, 1.0)), ladder((0.6, 1.0, 1.2, 1.4), eagle_depth=(1, 2, 2, 3), draft_rows=2)
    assert tree.rung("eagle3").depth_of(3) == 2 and chain.rung("eagle3").depth_of(3) == 3
    # one catch-up forward for both; then the chain's positions 1, 2 (1 row each) and the tree's
    # expansions at depth 1, 2 (2 rows each) run as separate forwards
    assert step_draft_batches([chain, tree], [("eagle3", 3), ("eagle3", 4)]) == [2, 1, 1, 2, 2]
    assert draft_batches([3, 3], [1, 2]) == [2, 1, 1, 2, 2] and draft_batches([3, 1]) == [2, 1, 1]
    cost = StepCost(Calibration((10.0, 10.5, 11.0, 11.5), 1.0, "t", 128, (1, 4), (1, 2, 3, 4),
                                ((10.0, 10.5, 11.0, 11.5), (20.0, 40.0, 60.0, 80.0)), (1.0, 2.0)))
    lads, choice = [chain, tree], [("eagle3", 3), ("eagle3", 4)]
    want = (2 + 1.0 + 1.4) / cost.predict(2, 2 + 7, [2, 1, 1, 2, 2])
    assert goodput(lads, choice, cost) == pytest.approx(want)
    st = _Step(lads, cost, choice)  # the incremental evaluator charges the same forwards
    assert st.value() == pytest.approx(want)


def test_tree_knobs_follow_sglang_and_bad_sizes_are_refused():
    assert tree_num_draft_tokens(4, 1, None) == 5 and tree_num_draft_tokens(4, 4, None) == 17
    assert EngineParams(num_draft_tokens=3, tree={"eagle_topk": 4, "num_draft_tokens": 16}).tree.num_draft_tokens == 16
    with pytest.raises(ValueError, match=r"engine.tree.*\[4, 37\]"):
        EngineParams(num_draft_tokens=3, tree={"eagle_topk": 4, "num_draft_tokens": 40})
    with pytest.raises(ValueError, match="eagle_topk 1"):
        EngineParams(num_draft_tokens=3, tree={"num_draft_tokens": 8})
    with pytest.raises(ValueError, match="eagle_topk"):
        EngineParams(tree={"eagle_topk": 0})


def test_a_probe_runs_the_best_tree_size_alone():
    cal = Calibration((10.0, 10.5, 11.0, 11.5), 1.0, "test", 128, (1, 4), (1, 2, 3, 4, 8),
                      ((10.0, 10.5, 11.0, 11.5, 13.0), (20.0, 40.0, 60.0, 80.0, 160.0)), (1.0, 2.0))
    pol = GoodputPolicy(cal)
    flat = ladder((0.1, 0.9, 0.95, 0.96, 0.97), eagle_depth=(1, 2, 2, 3, 3), draft_rows=2)
    assert (
        best_alone(flat, flat.rung("eagle3"), pol.cost) == 2
    )  # the knee: 2 nodes already return what more nodes would
    steep = ladder((0.1, 0.2, 0.3, 3.0))
    assert best_alone(steep, steep.rung("eagle3"), pol.cost) == 4


def test_widen_adds_the_nodes_that_still_pay_ancestors_first():
    t = _tree()  # values: a -0.1, b -1.0, c -0.3, d -2.0, e -0.5, f -1.2
    ident = lambda c: c  # noqa: E731 - the draft's confidence as the acceptance estimate
    # reach: a e^-0.1 = .905, c .741, e .607, b .368, f .301, d .135
    assert widen(t, [0], ident, 0.5, cap=10) == [0, 2, 4]
    assert widen(t, [0], ident, 0.3, cap=10) == [0, 1, 2, 5, 4]
    assert widen(t, [0], ident, 0.3, cap=3) == [0, 2, 4]  # by value until the cap
    assert widen(t, [0, 1], ident, 0.95, cap=10) == [0, 1]  # the plan's nodes stay


def test_step_costs_fed_back_match_the_draft_forwards_that_ran(tiny_target):
    """A step with a greedy tree request and a sampled chain request: the draft forwards observed
    by the cost model are the ones the engine ran (rows per forward, in order)."""
    cal = Calibration((10.0, 10.5, 11.0, 11.5), 1.0, "test", 128, (1, 4), (1, 2, 3, 4, 8),
                      ((10.0, 10.5, 11.0, 11.5, 13.0), (20.0, 40.0, 60.0, 80.0, 160.0)), (1.0, 2.0))
    pol = GoodputPolicy(cal, prior=1.0, margin=0.0)
    runner = DraftRunner(random_draft(tiny_target, 64, seed=4))
    ran: list[int] = []
    for name in ("extend_batch", "step_batch", "tree_step_batch"):
        f = getattr(runner, name)
        setattr(runner, name, lambda items, f=f, name=name: (
            ran.append(sum(i[1].shape[0] for i in items) if name == "tree_step_batch" else len(items)), f(items))[1])
    seen = []
    pol.observe_step = lambda b, rows, fw, ms: (seen.append((list(fw), ran[:])), ran.clear())
    eng = _tree_engine(tiny_target, runner, pol)
    eng.generate_batch([Request([5, 6, 7], 12, workload="a"),
                        Request([8, 9], 12, workload="a", sampling=SamplingParams(temperature=0.7, seed=None))])
    assert seen, "decode steps were observed"
    assert all(fw == ran_now for fw, ran_now in seen), seen
    assert [2, 1, 1, 2, 2] in [fw for fw, _ in seen]  # the mixed step: shared catch-up, chain, tree


def test_tree_requests_are_admitted_like_chains_and_fit_the_kv_room(tiny_target):
    runner = DraftRunner(random_draft(tiny_target, 64, seed=5))
    eng = Engine(
        tiny_target,
        runner,
        EngineParams(num_draft_tokens=3, max_seq_len=64, tree={"eagle_topk": 4, "num_draft_tokens": 13}),
    )
    prompt = list(range(3, 43))  # 40 + 16 new + k 3 + 1 = 60 <= 64: admitted; the tree shrinks near the end
    out = eng.generate(prompt, 16)
    assert (
        out.tokens
        == Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=64)).generate(prompt, 16).tokens
    )
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.generate(list(range(3, 49)), 16)


def _tree_engine(target, runner, policy):
    """A tree-drafting engine (eagle_topk 2, 7 draft tokens) under `policy`, without early stop."""
    tree = {"eagle_topk": 2, "num_draft_tokens": 7}
    cfg = EngineParams(num_draft_tokens=3, max_seq_len=256, draft_early_stop=False, tree=tree)
    return Engine(target, runner, cfg, policy=policy)
