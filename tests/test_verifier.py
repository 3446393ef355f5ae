"""The speculative verifier, tested where a broken one shows: every emitted position, the bonus
token, rejections with a partially overlapping draft, and drafts that the target accepts.

The rule under test: Leviathan et al. 2023 (arXiv 2211.17192), Algorithm 1. Draft token
x_i ~ q_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the
next token is drawn from norm(max(p_i − q_i, 0)); when all k are accepted a bonus token is drawn
from p_k = p(· | prefix + x_1..x_k). Then the emitted tokens are distributed exactly as sampling
from p one token at a time, and greedy speculative output is the target's greedy output.

Statistic everywhere: Pearson's chi-square goodness of fit (`scipy.stats.chisquare`) of observed
counts against the exact distribution, cells with expected count < 5 pooled into one cell (an
observed outcome of probability 0 gives p-value 0). A correct verifier must give p > 1e-3 on each
check; a broken one must give p < 1e-3. Seeds are fixed, so every p-value is deterministic.

Two targets: the conftest `tiny_target` (tied embeddings scaled ×8: its greedy output copies one
token forever, so a draft that copies is always right and a verifier that accepts everything
passes) and `varied` (the same config untied: greedy output changes token, so a trained draft is
right only part of the time). Everything here runs single-threaded (tiny matrices: threads only
contend, e.g. with a parallel test process).
"""
from __future__ import annotations

import itertools
import random
from collections import Counter
from dataclasses import replace

import pytest
import torch
from scipy.stats import chisquare

from conftest import TINY, make_varied_target, random_draft, train_on_greedy
from tidespec.config import EngineParams
from tidespec.engine.sampling import SamplingParams, rejection_verify, sample, warp
from tidespec.engine.speculative import Engine, Request
from tidespec.models.runner import DraftRunner

ALPHA = 1e-3  # chi-square threshold: p > ALPHA passes, p < ALPHA is a detected broken verifier


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -- chi-square helper -----------------------------------------------------------------------------
def chi2_pvalue(counts: Counter, probs: dict) -> float:
    """Pearson chi-square p-value of `counts` (outcome → count) against exact `probs` (outcome →
    probability, summing to 1). Cells with expected count < 5 are pooled into one cell (merged with
    the smallest other cell if the pool itself is still < 5); outcomes absent from `probs` are
    impossible: seeing one returns 0.0."""
    n = sum(counts.values())
    if any(c and probs.get(o, 0.0) == 0.0 for o, c in counts.items()):
        return 0.0
    big = sorted((o for o, p in probs.items() if p * n >= 5), key=lambda o: probs[o])
    small = [o for o, p in probs.items() if p * n < 5]
    obs = [float(counts.get(o, 0)) for o in big]
    exp = [probs[o] * n for o in big]
    pool_o, pool_e = sum(counts.get(o, 0) for o in small), sum(probs[o] for o in small) * n
    if pool_e >= 5 or (big == [] and pool_e > 0):
        obs.append(pool_o)
        exp.append(pool_e)
    elif pool_e > 0:  # a pool still under 5: merge it into the smallest cell
        obs[0] += pool_o
        exp[0] += pool_e
    if len(obs) < 2:
        return 1.0
    scale = sum(obs) / sum(exp)  # float rounding only
    return float(chisquare(obs, [e * scale for e in exp]).pvalue)


def marginals(seqs: Counter, L: int) -> list[Counter]:
    """Per-position token counts of a Counter over length-L tuples."""
    out = [Counter() for _ in range(L)]
    for s, c in seqs.items():
        for i, t in enumerate(s[:L]):
            out[i][t] += c
    return out


def exact_marginals(probs: dict, L: int) -> list[dict]:
    out = [Counter() for _ in range(L)]
    for s, p in probs.items():
        for i, t in enumerate(s):
            out[i][t] += p
    return [dict(m) for m in out]


def all_pvalues(seqs: Counter, probs: dict, L: int) -> dict[str, float]:
    """{'joint': p, 'pos0': p, ...}: the whole L-token sequence and each position's marginal."""
    pv = {"joint": chi2_pvalue(seqs, probs)}
    for i, (obs, ex) in enumerate(zip(marginals(seqs, L), exact_marginals(probs, L))):
        pv[f"pos{i}"] = chi2_pvalue(obs, ex)
    return pv


# -- 1. rejection sampling on a synthetic language --------------------------------------------------
V, K, L, N_DRAWS = 4, 2, 4, 16_000


def _row(prefix: tuple, salt: int) -> torch.Tensor:
    """A deterministic distribution over V tokens keyed by the whole prefix (and a salt)."""
    key = salt
    for t in prefix:
        key = key * 31 + t + 1
    g = torch.Generator().manual_seed(key % (2**61))
    return torch.softmax(1.6 * torch.randn(V, generator=g, dtype=torch.float64), -1).float()


class Language:
    """Target p(x | prefix) and draft q = 0.5·p + 0.5·noise(prefix), both depending on the whole
    prefix (so p_k = p(· | prefix + drafts) differs from p_{k-1}); rows are cached."""

    def __init__(self):
        self._p, self._q = {}, {}

    def p(self, prefix: tuple) -> torch.Tensor:
        if prefix not in self._p:
            self._p[prefix] = _row(prefix, 1)
        return self._p[prefix]

    def q(self, prefix: tuple) -> torch.Tensor:
        if prefix not in self._q:
            q = 0.5 * self.p(prefix) + 0.5 * _row(prefix, 2)
            self._q[prefix] = q / q.sum()
        return self._q[prefix]

    def exact(self, length: int) -> dict[tuple, float]:
        """P(x_1..x_L) = Π_t p(x_t | x_<t), every one of the V^L sequences."""
        out = {}
        for s in itertools.product(range(V), repeat=length):
            pr = 1.0
            for t in range(length):
                pr *= float(self.p(s[:t])[s[t]])
            out[s] = pr
        return out


def broken_verify(p, q, drafts, gen, *, bonus_row: int = 0, resample_from_p: bool = False):
    """`rejection_verify` with one plausible bug: bonus_row -1 draws the bonus token (all k
    accepted) from p[k-1] instead of p[k]; resample_from_p resamples a rejected position from p[i]
    instead of norm(max(p[i] − q[i], 0))."""
    k = len(drafts)
    for i, d in enumerate(drafts):
        pd, qd = float(p[i, d]), float(q[i, d])
        if qd > 0 and float(torch.rand((), generator=gen)) * qd < pd:
            continue
        resid = p[i] if resample_from_p else (p[i] - q[i]).clamp_min(0)
        z = float(resid.sum())
        return i, sample(resid / z if z > 0 else p[i], gen)
    return k, sample(p[k + bonus_row], gen)


def verify_bonus_from_wrong_row(p, q, drafts, gen):
    return broken_verify(p, q, drafts, gen, bonus_row=-1)


def verify_resample_from_p(p, q, drafts, gen):
    return broken_verify(p, q, drafts, gen, resample_from_p=True)


def simulate(verify, lang: Language, n_draws: int = N_DRAWS, seed: int = 0):
    """Speculative generation of L tokens, `n_draws` times: each step drafts K tokens chain-wise
    from q, verifies them against p rows for prefix + drafts[:i] (i = 0..K) and appends
    drafts[:n] + [next]. Returns (Counter over the first L tokens, accepted, drafted, bonus steps)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    rows: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
    cum: dict[tuple, list[float]] = {}
    seqs: Counter = Counter()
    accepted = drafted = bonus = 0
    for _ in range(n_draws):
        seq: tuple = ()
        while len(seq) < L:
            ctx = seq
            for _ in range(K):
                if ctx not in cum:
                    cum[ctx] = lang.q(ctx).cumsum(0).tolist()
                ctx += (rng.choices(range(V), cum_weights=cum[ctx])[0],)
            drafts = list(ctx[len(seq):])
            if ctx not in rows:
                rows[ctx] = (torch.stack([lang.p(ctx[:len(seq) + i]) for i in range(K + 1)]),
                             torch.stack([lang.q(ctx[:len(seq) + i]) for i in range(K)]))
            n, nxt = verify(*rows[ctx], drafts, gen)
            accepted, drafted, bonus = accepted + n, drafted + K, bonus + (n == K)
            seq += tuple(drafts[:n]) + (nxt,)
        seqs[seq[:L]] += 1
    return seqs, accepted, drafted, bonus


_sim_cache: dict = {}


def _simulated(name: str):
    if name not in _sim_cache:
        verify = {"real": rejection_verify, "bonus_from_p[k-1]": verify_bonus_from_wrong_row,
                  "resample_from_p": verify_resample_from_p}[name]
        lang = Language()
        _sim_cache[name] = (simulate(verify, lang), lang.exact(L))
    return _sim_cache[name]


def test_rejection_sampling_every_position_and_bonus_token():
    """`rejection_verify` on a synthetic language (V=4, k=2 drafts per step, L=4 tokens,
    16k draws, draft q = 0.5·p + 0.5·noise): the empirical distribution of the whole 4-token
    sequence and of each position equals the exact product distribution Π_t p(x_t | x_<t)
    (Pearson chi-square, cells with expected < 5 pooled, p > 1e-3 each). The draft is accepted
    part of the time (acceptance rate in (0.2, 0.9)) and the bonus path (n == k) is taken often
    (> 10 % of steps), so accept, reject and bonus all shape the emitted tokens."""
    (seqs, acc, drafted, bonus), exact = _simulated("real")
    rate = acc / drafted
    assert 0.2 < rate < 0.9, rate
    assert bonus > 0.1 * drafted / K, (bonus, drafted / K)
    pv = all_pvalues(seqs, exact, L)
    assert min(pv.values()) > ALPHA, pv


@pytest.mark.parametrize("name", ["real", "bonus_from_p[k-1]", "resample_from_p"])
def test_same_check_catches_broken_verifiers(name):
    """The check above, run on two mutants written here and on the real `rejection_verify`: the
    real one passes (every p-value > 1e-3), each mutant fails (smallest p-value < 1e-3)."""
    (seqs, *_), exact = _simulated(name)
    pv = all_pvalues(seqs, exact, L)
    if name == "real":
        assert min(pv.values()) > ALPHA, pv
    else:
        assert min(pv.values()) < ALPHA, pv


# -- targets and an accepted draft -----------------------------------------------------------------
@pytest.fixture(scope="module")
def varied(tmp_path_factory):
    """(HF dir, Target): conftest's TINY config with untied embeddings and lm_head × 16, so greedy
    output moves between tokens (the tied tiny target repeats one token) and a temperature-1
    top-4 distribution is spread (about 0.33 / 0.28 / 0.26 / 0.13 after a prompt)."""
    from tidespec.models.target import load_target

    path = make_varied_target(tmp_path_factory.mktemp("varied-target"))
    return path, load_target(path)[0]


@pytest.fixture(scope="module")
def trained(varied, tmp_path_factory):
    """(DraftRunner, prompts, reference Generations): an EAGLE3 draft trained with the repo's
    trainer (10 epochs, ~2 s) on the varied target's own greedy outputs (40 tokens) of 48 prompts
    of 6 ids from [3, 40). On those prompts it is right part of the time: greedy acceptance rate
    about 0.5 / 0.4 / 0.25 at k = 1 / 2 / 4, sampled (T=1, top-4) about 0.36 / 0.22 at k = 1 / 2."""
    from tidespec.models.eagle3 import load_checkpoint

    _, target = varied
    out = tmp_path_factory.mktemp("trained-draft")
    prompts, gens = train_on_greedy(target, out)
    return DraftRunner(load_checkpoint(out, target.embed, target.target_id)), prompts, gens


# -- 2. greedy engine == transformers generate ------------------------------------------------------
def hf_greedy(model, prompt: list[int], n: int, eos: list[int]) -> list[int]:
    """`generate(do_sample=False)`: new tokens only; stops after an EOS id, as the engine does."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("which", ["tiny_target", "varied"])
def test_greedy_engine_equals_transformers_generate(which, request):
    """Engine greedy output (target only, and speculative at k = 2, 3) == HF
    `LlamaForCausalLM.generate(do_sample=False)` (fp32, eval), token for token, 24 new tokens,
    EOS included where HF stops at it. tiny_target: a random draft; varied: the trained draft, and
    one prompt whose greedy output ends at EOS."""
    from transformers import LlamaForCausalLM

    if which == "tiny_target":
        path, target = request.getfixturevalue("tiny_target_dir"), request.getfixturevalue("tiny_target")
        runner = DraftRunner(random_draft(target, 64))
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in (1, 5, 11)]
    else:
        path, target = request.getfixturevalue("varied")
        runner, train_prompts, gens = request.getfixturevalue("trained")
        stops = [p for p, x in zip(train_prompts, gens) if x.finish_reason == "stop" and len(x.tokens) <= 24]
        assert stops, "no prompt of the set ends at EOS within 24 tokens"
        prompts = train_prompts[:3] + stops[:1]
    eos = list(target.cfg.eos_token_ids)
    assert eos == [TINY["eos_token_id"]]
    hf = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = Engine(target, runner, EngineParams(num_draft_tokens=3, max_seq_len=64))
    saw_stop = False
    for prompt in prompts:
        ref = hf_greedy(hf, prompt, 24, eos)
        assert len(ref) == 24 or ref[-1] in eos
        saw_stop |= ref[-1] in eos
        plain = eng.generate(prompt, 24, speculative=False)
        assert plain.tokens == ref, prompt
        assert plain.finish_reason == ("stop" if ref[-1] in eos else "length")
        for k in (2, 3):
            spec = eng.generate(prompt, 24, k=k)
            assert spec.tokens == ref, (prompt, k)
            assert spec.stats.num_drafts > 0
    assert saw_stop == (which == "varied")


# -- 3. losslessness with a draft the target accepts ------------------------------------------------
KS = (1, 2, 4)


def surplus(g) -> int:
    """(1 + num_drafts + num_accepted_tokens) − len(tokens): the prefill emits one token and each
    verify step accepted + 1, so this counts tokens the counters hold beyond the output."""
    return 1 + g.stats.num_drafts + g.stats.num_accepted_tokens - len(g.tokens)


def check_counters(g, k: int, max_new: int, eos: set[int]) -> None:
    """Invariants of a generation whose verify steps all drafted k tokens, on the engine before
    and after issue 18: k draft tokens per step, one timing entry per step, the output ends at
    max_new_tokens ("length") or at its first EOS ("stop"), and surplus ∈ {0, 1} (drafts past the
    cut are never counted accepted; 1 when the cut falls before the last step's bonus token)."""
    s = g.stats
    assert s.num_draft_tokens == k * s.num_drafts and len(g.timing.steps) == s.num_drafts
    assert surplus(g) in (0, 1), (surplus(g), s)
    if g.finish_reason == "length":
        assert len(g.tokens) == max_new and not eos & set(g.tokens)
    else:
        assert g.finish_reason == "stop" and g.tokens[-1] in eos and not eos & set(g.tokens[:-1])


@pytest.fixture(scope="module")
def lossless_runs(varied, trained):
    """{k: [(prompt, max_new_tokens, cut, speculative Generation, target-only tokens)]} on five of
    the draft's training prompts whose greedy output has no EOS in 40 tokens.

    Per prompt and k: a 40-token run (cut None: it may end anywhere in its last step), then two
    shorter ones. Greedy decoding is deterministic, so a shorter run takes the same verify steps
    as the 40-token run up to its end, and the 40-token run's steps (all but its last, whose
    count may be cut) give the step boundaries b = 1 + tokens emitted by the steps before.
    max_new_tokens = a boundary ≤ 30: the generation ends exactly at a step's end (cut False);
    = a boundary + 1 where the next step emitted ≥ 2 tokens: it ends inside that step, after its
    first accepted draft (cut True). The reference is the prefix of the target-only
    (speculative=False) 40-token output from `trained`."""
    _, target = varied
    runner, prompts, gens = trained
    eng = Engine(target, runner, EngineParams(num_draft_tokens=4, max_seq_len=128))
    cases = [(p, g.tokens) for p, g in zip(prompts, gens) if g.finish_reason == "length"][:5]
    assert len(cases) == 5
    runs = {}
    for k in KS:
        runs[k] = []
        for p, ref in cases:
            full = eng.generate(p, 40, k=k)
            runs[k].append((p, 40, None, full, ref))
            emitted = [n for _, n in full.timing.steps[:-1]]
            bounds = [1 + sum(emitted[:i]) for i in range(len(emitted) + 1)]
            at = max(b for b in bounds if b <= 30)
            inside = max((b + 1 for b, n in zip(bounds, emitted) if n >= 2 and b <= 30), default=None)
            for n, cut in ((at, False), (inside, True)):
                if n is not None:
                    runs[k].append((p, n, cut, eng.generate(p, n, k=k), ref[:n]))
    return runs


@pytest.mark.parametrize("k", KS)
def test_greedy_lossless_with_accepted_draft(varied, lossless_runs, k):
    """Greedy speculative output == target-only output, token for token, with a trained draft the
    target accepts part of the time: accepted > 0 in every generation and an overall acceptance
    rate in (0, 1), so the accept, mismatch and bonus paths all run. Counters: `check_counters`
    everywhere, and len(tokens) == 1 + num_drafts + num_accepted_tokens exactly when the
    generation ended at a step's end; generations cut inside a step are exercised too."""
    _, target = varied
    eos = set(target.cfg.eos_token_ids)
    acc = drafted = 0
    assert {r[2] for r in lossless_runs[k]} == {None, False, True}  # both kinds of ending are exercised
    for p, n, cut, spec, ref in lossless_runs[k]:
        assert spec.tokens == ref, (p, n, k)
        assert spec.stats.num_accepted_tokens > 0, (p, n, k, spec.stats)
        check_counters(spec, k, n, eos)
        if cut is False:
            assert surplus(spec) == 0, (p, n, k, spec.stats)
        acc, drafted = acc + spec.stats.num_accepted_tokens, drafted + spec.stats.num_draft_tokens
    assert 0 < acc < drafted, f"acceptance rate {acc}/{drafted} = {acc / drafted:.2f} at k={k}"


def test_counters_match_output_for_every_generation(lossless_runs):
    """Accepted counters never count a token past a stop / EOS / max_tokens cut: every verify step
    emits accepted + 1 tokens, except a last step cut inside its accepted drafts, which emits only
    the accepted drafts it keeps (all counted, the bonus dropped). So for generations whose steps
    were all speculative, 1 + num_drafts + num_accepted_tokens − len(tokens) is 1 exactly when the
    run ended one or more tokens inside a step's accepted drafts, else 0."""
    for k, runs in lossless_runs.items():
        for p, n, cut, spec, _ in runs:
            want = (0, 1) if cut is None else ((1,) if cut else (0,))  # cut None: a 40-token run ends anywhere
            assert surplus(spec) in want, (p, n, k, cut, spec.stats)


def exact_sequences(target, prompt: list[int], sp: SamplingParams, n: int) -> dict[tuple, float]:
    """P(t_1..t_n | prompt) under the target with `sp` (temperature, top-k) applied at every
    position, every sequence of the support enumerated through the target (top_k=4, n=3: 64)."""
    cache = target.new_cache(len(prompt) + n)
    out: dict[tuple, float] = {}

    def walk(prefix: tuple, prob: float, logits: torch.Tensor):
        probs = warp(logits, sp)
        for t in probs.nonzero().flatten().tolist():
            pr = prob * float(probs[t])
            if len(prefix) + 1 == n:
                out[prefix + (t,)] = pr
                continue
            cache.crop(len(prompt) + len(prefix))
            walk(prefix + (t,), pr, target.forward(torch.tensor([t]), cache, need_hidden=False).logits[0])

    walk((), 1.0, target.forward(torch.tensor(prompt), cache, need_hidden=False).logits[-1])
    return out


N_SAMPLED = 2400


@pytest.mark.parametrize("k", (1, 2))
def test_sampled_speculation_matches_target_distribution(varied, trained, k):
    """Temperature 1.0, top_k=4, the trained draft at k (k=1: token 3 is the bonus token whenever
    token 2's draft is accepted): the first 3 emitted tokens over 2400 seeded requests follow the
    target's exact distribution, enumerated through the target (64 sequences). Pearson chi-square
    on the joint 3-token sequence and on each position's marginal (cells < 5 expected pooled),
    p > 1e-3 each; the draft's tokens are accepted (accepted > 0, rate in the message)."""
    _, target = varied
    runner, prompts, _ = trained
    prompt, L3 = prompts[0], 3
    sp = SamplingParams(1.0, top_k=4)
    exact = exact_sequences(target, prompt, sp, L3)
    assert len(exact) == 4 ** L3 and abs(sum(exact.values()) - 1) < 1e-4
    eng = Engine(target, runner, EngineParams(num_draft_tokens=k, max_seq_len=32, max_batch=64))
    gens = eng.generate_batch([Request(prompt, L3, k=k, sampling=replace(sp, seed=i)) for i in range(N_SAMPLED)])
    seqs = Counter(tuple(g.tokens) for g in gens)
    acc = sum(g.stats.num_accepted_tokens for g in gens)
    drafted = sum(g.stats.num_draft_tokens for g in gens)
    assert all(len(s) == L3 for s in seqs)
    assert acc > 0, f"acceptance rate {acc}/{drafted}"
    pv = all_pvalues(seqs, exact, L3)
    assert min(pv.values()) > ALPHA, (pv, f"acceptance rate {acc}/{drafted} = {acc / drafted:.2f}")


def _step_ends(gen) -> list[tuple[int, int]]:
    """(index in gen.tokens of a verify step's last token, tokens the step emitted) per step; the
    first token comes from the prefill."""
    ends, at = [], 0
    for _, m in gen.timing.steps:
        at += m
        ends.append((at, m))
    return ends


def test_rejected_tokens_are_the_ends_of_the_steps_a_rejection_cut_short(lossless_runs):
    """Generation.rejected (the tokens the target emitted in place of a draft proposal it rejected) on
    greedy chains of k drafts: the last token of every verify step that emitted fewer than k + 1
    tokens, none of a step that emitted k + 1 (all drafts accepted); a generation's last step may end
    on the length cut either way. Both kinds of step occur."""
    short = full = 0
    for k, runs in lossless_runs.items():
        for p, _, cut, spec, _ in runs:
            if cut is not None:
                continue
            ends = _step_ends(spec)
            want = [t for t, m in ends[:-1] if m < k + 1]
            assert spec.rejected[:len(want)] == want, (p, k, ends)
            assert spec.rejected[len(want):] in ([], [ends[-1][0]]), (p, k, ends, spec.rejected)
            short, full = short + len(want), full + sum(m == k + 1 for _, m in ends[:-1])
    assert short > 0 and full > 0, (short, full)


def test_rejected_tokens_of_a_tree_end_steps_that_stopped_above_a_drafted_child(varied, trained):
    """On EAGLE-2 trees (depth 3, top-2): every rejected token ends a verify step, and a step that
    accepted a path down to the full depth (a leaf: no child was rejected) is never one."""
    _, target = varied
    runner, prompts, _ = trained
    eng = Engine(target, runner, EngineParams(num_draft_tokens=3, max_seq_len=128, tree={"eagle_topk": 2}))
    deep = rejected = 0
    for p in prompts[:6]:
        gen = eng.generate(p, 40)
        ends = _step_ends(gen)
        assert set(gen.rejected) <= {t for t, _ in ends}, (p, ends, gen.rejected)
        assert not set(gen.rejected) & {t for t, m in ends if m == 4}, (p, ends, gen.rejected)
        assert gen.rejected == sorted(gen.rejected)
        deep, rejected = deep + sum(m == 4 for _, m in ends), rejected + len(gen.rejected)
    assert deep > 0 and rejected > 0, (deep, rejected)


def test_the_positions_capture_weighs_are_where_the_served_draft_was_wrong(varied, trained):
    """k = 1 chains with the trained draft, captured: each generated token after the first is an
    accepted draft (the first of a two-token step), a bonus token, or the target's token in place of
    a rejected draft (a one-token step). The draft's own prediction of token q, teacher-forced on the
    captured aux (`ttt_forward` step 0, row q − 2), is wrong at every position `rejected_positions`
    lists (p = q − 1: the distribution the trainer holds those rows to) and right at every accepted
    draft: the weight lands where the served draft failed, not a token later."""
    from tidespec.capture.writer import rejected_positions
    _, target = varied
    runner, prompts, _ = trained
    eng = Engine(target, runner, EngineParams(num_draft_tokens=1, max_seq_len=128))
    wrong = right = 0
    for p in prompts[:8]:
        gen = eng.generate(p, 40, k=1, capture=True)
        P, rec, seq = len(p), gen.record, p + gen.tokens
        with torch.no_grad():
            h = runner.draft.ttt_forward(rec["aux_hidden_states"][None].float(), rec["input_ids"][None].long(), 1)[0]
            pred = runner.draft.logits(h[0]).argmax(-1)
        pred = pred + runner.draft.d2t[pred]  # draft ids → target ids; row r predicts token r + 2
        weighted, ends = set(rejected_positions(gen)), _step_ends(gen)
        for end, m in ends[:-1]:  # the last step may be cut by the length
            first = end - m + 1  # index in gen.tokens of the step's first token
            q = P + first
            if m == 1:
                assert q - 1 in weighted and int(pred[q - 2]) != seq[q], (p, first)
                wrong += 1
            else:
                assert q - 1 not in weighted and int(pred[q - 2]) == seq[q], (p, first)
                right += 1
        assert weighted <= {P + e - 1 for e, _ in ends}
    assert wrong > 0 and right > 0, (wrong, right)
