"""Chain speculative decoding with an EAGLE3 draft: one target forward verifies k drafted tokens.

Algorithm: Leviathan et al. 2023 (arXiv 2211.17192) §2: the draft proposes k tokens
autoregressively (EAGLE-3 feeds its own hidden state forward, arXiv 2503.01840 §3); the target
scores [last token, d_1..d_k] in one forward. Greedy: the longest prefix where d_i equals the
target's argmax is accepted and the target's own token at the first mismatch is the bonus, so the
output is the target's greedy output token for token (fp32: see models/target.py). Sampling:
lossless rejection sampling (engine/sampling.py).
"""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from ..models.eagle3 import DraftRunner
from ..models.target import Target
from .sampling import GREEDY, SamplingParams, rejection_verify, sample, warp
from .stats import RequestTiming, SpecDecodingStats


@dataclass
class Generation:
    """Result of one request.

    tokens: generated ids (prompt excluded); stats: per-request spec-decode counters; timing:
    prefill and per-step wall times; record: capture tensors (when `capture=True`):
    input_ids `[T]` int32, loss_mask `[T]` uint8, aux_hidden_states `[T, 3H]`, hidden_states `[T, H]`
    where T = tokens the target processed (prompt + generated minus the last, whose hidden state
    is never computed).
    """

    request_id: str
    prompt_len: int
    tokens: list[int]
    stats: SpecDecodingStats
    timing: RequestTiming
    draft_version: str | None = None
    record: dict[str, torch.Tensor] | None = None
    finish_reason: str = "length"

    @property
    def tokens_per_s(self) -> float:
        t = self.timing.prefill_s + self.timing.decode_s
        return len(self.tokens) / t if t > 0 else 0.0


@dataclass
class _Rows:
    """Accumulates the target's aux/hidden rows of processed positions for capture."""

    aux: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)

    def add(self, out, n: int):
        self.aux.append(out.aux[:n])
        self.hidden.append(out.hidden[:n])


class Engine:
    """Embedded single-sequence engine: target + optional EAGLE3 draft, hot-swappable.

    `set_draft` swaps the draft atomically; a request keeps the draft it started with, so requests
    in flight finish unchanged and the next request uses the new one.
    """

    def __init__(self, target: Target, draft: DraftRunner | None = None, num_draft_tokens: int = 4,
                 max_seq_len: int = 1024, draft_version: str | None = None):
        if num_draft_tokens < 1:
            raise ValueError("num_draft_tokens (k) must be >= 1; use speculative=False to turn speculation off")
        self.target = target
        self.k = num_draft_tokens
        self.max_seq_len = max_seq_len
        self._lock = threading.Lock()
        self._draft = draft
        self._draft_version = draft_version
        if draft is not None:
            self._check_draft(draft)

    def _check_draft(self, draft: DraftRunner) -> None:
        c, t = draft.config, self.target.cfg
        if c.vocab_size != t.vocab_size or c.target_hidden_size != t.hidden_size:
            raise ValueError(f"draft (V={c.vocab_size}, Ht={c.target_hidden_size}) does not fit the target "
                             f"(V={t.vocab_size}, H={t.hidden_size})")
        if tuple(c.aux_layer_ids) != tuple(self.target.aux_layers):
            raise ValueError(f"draft aux layers {c.aux_layer_ids} != target capture layers {self.target.aux_layers}")
        if c.target_id and self.target.target_id != "unknown" and c.target_id != self.target.target_id:
            raise ValueError(f"draft trained for target {c.target_id[:12]}, serving {self.target.target_id[:12]}")

    def set_draft(self, draft: DraftRunner | None, version: str | None = None) -> None:
        """Swap the draft (None = no speculation). Raises ValueError for a draft of another target."""
        if draft is not None:
            self._check_draft(draft)
        with self._lock:
            self._draft, self._draft_version = draft, version

    @property
    def draft_version(self) -> str | None:
        return self._draft_version

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, speculative: bool = True,
                 k: int | None = None, capture: bool = False, request_id: str | None = None,
                 sampling: SamplingParams = GREEDY) -> Generation:
        """Generate up to `max_new_tokens` after `prompt_ids` (stops at EOS); greedy by default.

        Raises ValueError for an empty prompt, k < 1, or prompt + max_new_tokens beyond
        `max_seq_len` (the fix: shorten the prompt or raise engine.max_seq_len); bad sampling
        values are refused when `SamplingParams` is built.
        """
        if not prompt_ids:
            raise ValueError("empty prompt: send at least one token")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        k = self.k if k is None else k
        if k < 1:
            raise ValueError("k (num_draft_tokens) must be >= 1")
        need = len(prompt_ids) + max_new_tokens + k + 1
        if need > self.max_seq_len:
            raise ValueError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({max_new_tokens}) + k + 1 = {need} "
                             f"exceeds max_seq_len {self.max_seq_len}; shorten the prompt or raise engine.max_seq_len")
        with self._lock:
            draft, version = (self._draft, self._draft_version) if speculative else (None, None)
        rid = request_id or uuid.uuid4().hex
        greedy = sampling.greedy
        gen_rng = None if greedy else sampling.generator()

        def pick(logits: torch.Tensor) -> int:
            return int(logits.argmax()) if greedy else sample(warp(logits, sampling), gen_rng)

        eos = set(self.target.cfg.eos_token_ids)
        stats = SpecDecodingStats(k if draft else 0)
        timing = RequestTiming()
        rows = _Rows()
        tgt = self.target
        cache = tgt.new_cache(self.max_seq_len)
        prompt = torch.tensor(prompt_ids, dtype=torch.int64)

        t0 = time.perf_counter()
        out = tgt.forward(prompt, cache, need_hidden=capture or draft is not None)
        nxt = pick(out.logits[-1])
        if capture:
            rows.add(out, len(prompt_ids))
        gen = [nxt]
        dcache = None
        if draft is not None:
            dcache = draft.new_cache(self.max_seq_len)
            shifted = torch.cat([prompt[1:], torch.tensor([nxt])])
            h, dl = draft.extend(out.aux, shifted, dcache)
            h, dl = h[-1:], dl[-1]
        timing.prefill_s = time.perf_counter() - t0

        while len(gen) < max_new_tokens and nxt not in eos:
            t1 = time.perf_counter()
            if draft is None:
                out = tgt.forward(torch.tensor([nxt]), cache, need_hidden=capture)
                if capture:
                    rows.add(out, 1)
                nxt = pick(out.logits[0])
                gen.append(nxt)
                timing.steps.append((time.perf_counter() - t1, 1))
                continue
            # draft k tokens (chain)
            base = dcache.length
            drafts, qs = [], []
            for j in range(k):
                if greedy:
                    d = draft.to_target_ids(dl.argmax().view(1))
                else:
                    q = draft.to_target_probs(warp(dl, sampling))
                    d = torch.multinomial(q, 1, generator=gen_rng)
                    qs.append(q)
                drafts.append(int(d))
                if j < k - 1:
                    h, dl = draft.step(h, d, dcache)
                    dl = dl[0]
            # verify in one target forward
            L = cache.length
            out = tgt.forward(torch.tensor([nxt] + drafts), cache, need_hidden=True)
            if greedy:
                preds = out.logits.argmax(-1).tolist()
                n = 0
                while n < k and drafts[n] == preds[n]:
                    n += 1
                new = drafts[:n] + [preds[n]]
            else:
                n, tok = rejection_verify(warp(out.logits, sampling), torch.stack(qs), drafts, gen_rng)
                new = drafts[:n] + [tok]
            cache.crop(L + n + 1)
            if capture:
                rows.add(out, n + 1)
            stats.observe(k, n)
            dcache.length = base
            h, dl = draft.extend(out.aux[:n + 1], torch.tensor(new), dcache)
            h, dl = h[-1:], dl[-1]
            gen.extend(new)
            nxt = new[-1]
            timing.steps.append((time.perf_counter() - t1, len(new)))
            if any(t in eos for t in new):
                break

        # truncate at EOS / max_new_tokens: the accepted stream is the greedy stream, so this is exact
        finish = "length"
        for i, t in enumerate(gen):
            if t in eos:
                gen, finish = gen[:i + 1], "stop"
                break
        gen = gen[:max_new_tokens]
        gen_result = Generation(rid, len(prompt_ids), gen, stats, timing, version, finish_reason=finish)
        if capture:
            T = len(prompt_ids) + len(gen) - 1
            ids = torch.tensor(prompt_ids + gen[:-1], dtype=torch.int32)
            mask = torch.zeros(T, dtype=torch.uint8)
            mask[len(prompt_ids):] = 1
            gen_result.record = {"input_ids": ids, "loss_mask": mask,
                                 "aux_hidden_states": torch.cat(rows.aux)[:T],
                                 "hidden_states": torch.cat(rows.hidden)[:T]}
        return gen_result
