"""The request's logits transforms at every verified position, given that position's prefix
(`RequestLogits`).

Row i of a verify forward is transformed as if drafts[:i] were already generated (penalties count
them, min_tokens lifts where the output reaches it); the draft's proposal at position j gets the
same transforms with prefix drafts[:j], so rejection sampling stays exact (Leviathan et al. 2023,
Algorithm 1: any q). Order and definitions follow vLLM's sampler (`vllm/v1/sample/sampler.py`):
min_tokens, logit_bias, repetition / frequency / presence penalties; temperature, min_p, top-k and
top-p come after (`sampling.warp`); a grammar masks last. Raises InvalidRequest for token ids
outside the vocabulary. More: docs/design/engine.md.
"""
from __future__ import annotations

import torch

from .grammar_state import GrammarState
from .invalid import InvalidRequest
from .sampling import SamplingParams


def check_token_ids(sp: SamplingParams, vocab_size: int) -> None:
    """Raise InvalidRequest (field logit_bias or stop_token_ids) for a token id outside [0, vocab_size)."""
    for field, ids in (("logit_bias", sp.logit_bias), ("stop_token_ids", sp.stop_token_ids)):
        for t in ids:
            if t >= vocab_size:
                raise InvalidRequest(field, f"token id {t} in {field} is outside the vocabulary [0, {vocab_size})")


class RequestLogits:
    """Transforms of one request; `apply` is pure, `advance` records emitted tokens.

    sp: the request's SamplingParams; prompt_ids: its prompt (repetition penalty); vocab_size: V;
    eos_ids: the target's EOS ids (masked by min_tokens unless ignore_eos); grammar: the request's
    matcher (None: unconstrained). Raises InvalidRequest for a logit_bias or stop token id outside [0, V).
    """

    def __init__(self, sp: SamplingParams, prompt_ids: list[int], vocab_size: int, eos_ids: set[int],
                 grammar: GrammarState | None = None):
        check_token_ids(sp, vocab_size)
        self.sp, self.V, self.n_out, self.grammar = sp, vocab_size, 0, grammar
        # the ids that end the request (EOS unless ignore_eos, stop_token_ids); masked until min_tokens
        self.stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids))
        self._stop_ids = torch.tensor(sorted(self.stop_ids), dtype=torch.int64) \
            if sp.min_tokens and self.stop_ids else None
        self._bias_ids = torch.tensor(list(sp.logit_bias), dtype=torch.int64)
        self._bias = torch.tensor(list(sp.logit_bias.values()), dtype=torch.float32)
        self._penalized = sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1
        self._counts = torch.zeros(vocab_size) if self._penalized else None  # output token counts `[V]`
        self._prompt = None
        if sp.repetition_penalty != 1:
            self._prompt = torch.zeros(vocab_size, dtype=torch.bool)
            self._prompt[torch.tensor(prompt_ids, dtype=torch.int64)] = True

    @property
    def active(self) -> bool:
        """False when the transforms are the identity (the engine's fast path skips them)."""
        return self._stop_ids is not None or len(self._bias_ids) > 0 or self._penalized or self.grammar is not None

    def apply(self, logits: torch.Tensor, drafts: list[int], start: int = 0) -> torch.Tensor:
        """Processed logits `[n, V]` fp32 from logits `[n, V]` (unchanged input): row i as if the
        output so far were followed by drafts[:start + i]."""
        x = logits.float().clone()
        n = x.shape[0]
        if self._stop_ids is not None:
            lens = self.n_out + start + torch.arange(n)  # output length before each row's token
            rows = (lens < self.sp.min_tokens).nonzero().squeeze(-1)
            if len(rows):
                x[rows[:, None], self._stop_ids[None]] = float("-inf")
        if len(self._bias_ids):
            x[:, self._bias_ids] += self._bias
        if self._penalized:
            x = self._penalize(x, self._row_counts(drafts, start, n))
        if self.grammar is not None:
            x.masked_fill_(~self.grammar.masks(list(drafts[:start + n - 1]), n), float("-inf"))
        return x

    def _row_counts(self, drafts: list[int], start: int, n: int) -> torch.Tensor:
        """Output token counts `[n, V]` seen by each row: the output plus drafts[:start + i]."""
        base = self._counts.clone()
        if start:
            base.index_add_(0, torch.tensor(drafts[:start]), torch.ones(start))
        counts = base.expand(n, -1).clone()
        for i in range(1, n):
            counts[i:, drafts[start + i - 1]] += 1
        return counts

    def _penalize(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        sp, seen = self.sp, counts > 0
        if sp.repetition_penalty != 1:
            mask = seen | self._prompt[None]
            x = torch.where(mask, torch.where(x > 0, x / sp.repetition_penalty, x * sp.repetition_penalty), x)
        return x - sp.frequency_penalty * counts - sp.presence_penalty * seen.float()

    def advance(self, tokens: list[int]) -> None:
        """Record emitted output tokens (the grammar's state advances past them)."""
        self.n_out += len(tokens)
        if self.grammar is not None:
            self.grammar.advance(tokens)
        if self._penalized and tokens:
            self._counts.index_add_(0, torch.tensor(tokens), torch.ones(len(tokens)))
