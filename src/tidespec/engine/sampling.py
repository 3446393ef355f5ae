"""Sampling parameters, logits warping and lossless speculative rejection sampling.

Verification rule: Leviathan et al. 2023 (arXiv 2211.17192, Algorithm 1) and Chen et al. 2023
(arXiv 2302.01318, §2.3): draft token x ~ q is accepted with probability min(1, p(x)/q(x)); on the
first rejection a token is drawn from norm(max(p − q, 0)); if all k are accepted a bonus token is
drawn from p at the next position. The emitted tokens are distributed exactly as sampling from p.
p and q are the *warped* distributions (temperature, top-k, top-p applied to both).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 = greedy (below 1e-5 counts as 0, as in vLLM: smaller values overflow the
    softmax). top_k 0 = off. seed None = nondeterministic. Bad values raise ValueError."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        num = (int, float)
        if not isinstance(self.temperature, num) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, num) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def generator(self) -> torch.Generator:
        g = torch.Generator()
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


GREEDY = SamplingParams()


def warp(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Probabilities `[..., V]` fp32 from logits `[..., V]` after temperature, top-k and top-p.

    Top-p keeps the smallest set of most likely tokens whose mass reaches top_p (HF
    `TopPLogitsWarper` semantics: the token crossing the threshold is kept).
    """
    x = logits.float() / sp.temperature
    if sp.top_k and sp.top_k < x.shape[-1]:
        kth = torch.topk(x, sp.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if sp.top_p < 1.0:
        sp_, idx = probs.sort(dim=-1, descending=True)
        cum = sp_.cumsum(-1)
        drop = (cum - sp_) >= sp.top_p  # mass before this token already reaches top_p
        sp_ = sp_.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sp_)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, gen: torch.Generator) -> int:
    """One draw from a `[V]` distribution."""
    return int(torch.multinomial(probs, 1, generator=gen))


def rejection_verify(p: torch.Tensor, q: torch.Tensor, drafts: list[int], gen: torch.Generator) -> tuple[int, int]:
    """Verify k drafted tokens. p: target probs `[k+1, V]`; q: draft probs `[k, V]` (each drafts[i] ~ q[i]).

    Returns (number accepted n, next token): the emitted tokens are drafts[:n] + [next].
    """
    k = len(drafts)
    for i, d in enumerate(drafts):
        pd, qd = float(p[i, d]), float(q[i, d])
        if qd > 0 and float(torch.rand((), generator=gen)) * qd < pd:  # u < p/q, no division
            continue
        resid = (p[i] - q[i]).clamp_min(0)
        z = float(resid.sum())
        return i, sample(resid / z if z > 0 else p[i], gen)
    return k, sample(p[k], gen)
