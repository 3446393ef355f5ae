"""Lossless rejection sampling: exact one-step probabilities, chi-square over 20k draws, end to end."""
import pytest
import torch
from scipy.stats import chisquare

from conftest import random_draft
from tidespec.config import EngineParams
from tidespec.engine.sampling import SamplingParams, rejection_verify, warp
from tidespec.engine.speculative import Engine
from tidespec.models.runner import DraftRunner


def first_token_prob(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact probability `[V]` that `rejection_verify` emits token x first (one step, rows p[0], q[0]).

    P(x) = q(x)·min(1, p(x)/q(x)) + (1 − Σ_y min(p(y), q(y))) · norm(max(p − q, 0))(x); equals p(x).
    """
    acc = torch.minimum(p, q)
    resid = (p - q).clamp_min(0)
    z = resid.sum()
    return acc + (1 - acc.sum()) * (resid / z if z > 0 else p)


def _dist(V, seed, sharp=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(V, generator=g), -1)


def test_exact_one_step_probabilities():
    for s in range(5):
        p, q = _dist(16, s), _dist(16, 100 + s)
        q[3] = 0.0  # draft vocab without token 3: only reachable by resampling
        q = q / q.sum()
        torch.testing.assert_close(first_token_prob(p, q), p, atol=1e-6, rtol=0)


def test_chi_square_first_emitted_token_20k():
    V, k, N = 12, 3, 20000
    p = torch.stack([_dist(V, i) for i in range(k + 1)])
    q = torch.stack([_dist(V, 50 + i) for i in range(k)])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(V)
    for _ in range(N):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(k)]
        n, tok = rejection_verify(p, q, drafts, gen)
        counts[drafts[0] if n > 0 else tok] += 1
    assert chisquare(counts.numpy(), (p[0] * N).numpy()).pvalue > 0.01


def test_warp_top_k_top_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.allclose(warp(logits, SamplingParams(1.0, top_k=2)), torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(warp(logits, SamplingParams(1.0, top_p=0.7)), torch.tensor([0.625, 0.375, 0, 0]))
    assert torch.allclose(warp(logits, SamplingParams(1.0, top_p=0.5)), torch.tensor([1.0, 0, 0, 0]))
    hot = warp(logits, SamplingParams(2.0))
    assert hot[0] < 0.5 and hot[3] > 0.05  # temperature flattens


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_sampling_values_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_end_to_end_first_speculative_token(tiny_target):
    """Token 2 is the first one that speculation decides; its distribution must equal the target's
    exact marginal Σ_t1 p(t1) p(t2 | t1)."""
    T = tiny_target
    sp = SamplingParams(temperature=1.5, top_k=8, seed=None)
    prompt = [5, 17, 42]
    c = T.new_cache(16)
    p1 = warp(T.forward(torch.tensor(prompt), c, need_hidden=False).logits[-1], sp)
    marg = torch.zeros(T.cfg.vocab_size)
    for t1 in p1.nonzero().squeeze(-1).tolist():
        c.crop(3)
        marg += p1[t1] * warp(T.forward(torch.tensor([t1]), c, need_hidden=False).logits[0], sp)
    eng = Engine(T, DraftRunner(random_draft(T, 64)), EngineParams(num_draft_tokens=2, max_seq_len=16))
    N = 2000
    counts = torch.zeros(T.cfg.vocab_size)
    for i in range(N):
        g = eng.generate(prompt, 2, sampling=SamplingParams(1.5, top_k=8, seed=i))
        counts[g.tokens[1]] += 1
    keep = marg * N >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([marg[keep] * N, (marg[~keep].sum() * N).view(1)])
    obs, exp = (obs, exp) if exp[-1] > 0 else (obs[:-1], exp[:-1])
    assert chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue > 0.01


def test_seeded_sampling_is_reproducible_and_speculation_is_exercised(tiny_target):
    eng = Engine(
        tiny_target, DraftRunner(random_draft(tiny_target, 64)), EngineParams(num_draft_tokens=3, max_seq_len=128)
    )
    a = eng.generate([5, 6, 7], 32, sampling=SamplingParams(0.8, top_p=0.9, seed=7))
    b = eng.generate([5, 6, 7], 32, sampling=SamplingParams(0.8, top_p=0.9, seed=7))
    assert a.tokens == b.tokens and a.stats.num_drafts > 0
