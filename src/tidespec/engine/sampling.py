"""Sampling parameters, logits warping and lossless speculative rejection sampling.

Verification rule: Leviathan et al. 2023 (arXiv 2211.17192, Algorithm 1) and Chen et al. 2023
(arXiv 2302.01318, §2.3): draft token x ~ q is accepted with probability min(1, p(x)/q(x)); on the
first rejection a token is drawn from norm(max(p − q, 0)); if all k are accepted a bonus token is
drawn from p at the next position. The emitted tokens are distributed exactly as sampling from p.
p and q are the *processed and warped* distributions: the request's logits transforms
(`engine.logits`: min_tokens, logit_bias, penalties, each row given its own prefix) and then
temperature, min_p, top-k, top-p are applied to both, in vLLM's order (`vllm/v1/sample/sampler.py`).
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
LOGPROB_FLOOR = -9999.0  # -inf (a token top-k/top-p/min_p removed) as vLLM's OpenAI server reports it


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling and stopping parameters; vLLM `SamplingParams` semantics.

    temperature: 0 = greedy (below 1e-5 counts as 0, as in vLLM: smaller values overflow the
    softmax). top_p in (0, 1]; top_k 0 = off; min_p in [0, 1] (drop tokens below min_p × the top
    token's probability). seed None = nondeterministic.
    presence_penalty / frequency_penalty in [-2, 2] (subtracted per generated occurrence, OpenAI's
    definition), repetition_penalty > 0 (1 = off; CTRL, Keskar et al. 2019 §4.1: logits of tokens
    seen in prompt or output divided by it when positive, multiplied when negative); logit_bias:
    target token id → bias in [-100, 100] added to the logit.
    min_tokens: EOS and stop_token_ids are masked until this many tokens are generated;
    stop_token_ids: extra ids that end the request (finish "stop", kept in the output like EOS);
    ignore_eos: EOS does not end the request.
    logprobs: None = off, n in [0, 20] = the chosen token's log-probability plus the n most likely
    (`Generation.logprobs`; `logprobs_of` gives the definition). Bad values raise ValueError.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        if not _num(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _num(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not _int(self.seed) or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63) or None, got {self.seed!r}")
        if not _num(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _num(v) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not _num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty!r}")
        if not isinstance(self.logit_bias, Mapping):
            raise ValueError("logit_bias must map token ids to biases")
        for t, b in self.logit_bias.items():
            if not _int(t) or t < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {t!r}")
            if not _num(b) or not -100 <= b <= 100:
                raise ValueError(f"logit_bias[{t}] must be in [-100, 100], got {b!r}")
        if not _int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if not isinstance(self.stop_token_ids, tuple) or not all(_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a tuple of token ids >= 0, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.logprobs is not None and (not _int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

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
    """Probabilities `[..., V]` fp32 from (processed) logits `[..., V]` after temperature, min_p,
    top-k and top-p, in vLLM's order (`vllm/v1/sample/sampler.py`: temperature, the argmax-invariant
    min_p processor, then top-k/top-p).

    min_p drops tokens whose probability is below min_p × the most likely token's (Nguyen et al.
    2024, arXiv 2407.01082 §3). Top-p keeps the smallest set of most likely tokens whose mass
    reaches top_p (HF `TopPLogitsWarper` semantics: the token crossing the threshold is kept).
    """
    x = logits.float() / sp.temperature
    if sp.min_p > 0:
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < sp.min_p * probs.amax(-1, keepdim=True), float("-inf"))
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


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability (natural log) and the `top` most likely (id, logprob)
    at its position, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_of(processed: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Log-probabilities `[n, V]` fp32 reported for rows of processed logits `[n, V]` (after
    min_tokens, logit_bias and penalties): vLLM's `logprobs_mode="processed_logprobs"`
    (`vllm/v1/sample/sampler.py`): greedy requests get log_softmax of the processed logits,
    sampled ones the log of the distribution the token is drawn from (temperature, min_p, top-k,
    top-p applied; removed tokens at `LOGPROB_FLOOR`)."""
    if sp.greedy:
        return torch.log_softmax(processed.float(), dim=-1)
    return torch.log(warp(processed, sp)).clamp_min(LOGPROB_FLOOR)


def token_logprobs(lp: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """`TokenLogprob` of tokens[i] at row i of log-probabilities `lp` `[≥len(tokens), V]`."""
    out = []
    vals, ids = (lp[:len(tokens)].topk(top, dim=-1) if top else (None, None))
    for i, t in enumerate(tokens):
        tops = tuple(zip(ids[i].tolist(), vals[i].tolist())) if top else ()
        out.append(TokenLogprob(t, float(lp[i, t]), tops))
    return out


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
