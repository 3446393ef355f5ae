"""Teacher-forced holdout evaluation of a draft: per-position accuracy over the TTT chain, the conditional
acceptance a_j it implies (chains started where the engine would start them), and the simulated τ (EAGLE-3,
arXiv 2503.01840 §3; SpecForge's eval)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from ..config import TrainParams
from ..engine.stats import simulated_acceptance_length
from ..models.eagle3 import Eagle3Draft, load_checkpoint
from ..models.target import Target
from ..models.ttt import Example, ttt_outcomes
from .examples import prepare


def conditional_acceptance(correct: torch.Tensor) -> list[float]:
    """Conditional per-position acceptance from per-chain outcomes.

    correct: `[N, S]` bool, row n = one chain start, column j = whether the draft's (j+1)-th
    chained token there is the target's greedy token (a step past the end of the text counts as
    wrong). Returns S values a_j = #(rows right at steps 0..j) / #(rows right at steps 0..j-1), in
    [0, 1]; 0.0 where no row reached step j. With these, `simulated_acceptance_length(a[:k])` =
    1 + mean over rows of the leading run of right steps, capped at k (the product telescopes).
    Raises ValueError unless `correct` is 2-D.
    """
    if correct.dim() != 2:
        raise ValueError(f"correct must be [N, S] bool, got shape {tuple(correct.shape)}")
    run = torch.cumprod(correct.bool().long(), dim=1)  # [N, S]: 1 while every step so far was right
    reached = torch.cat([torch.ones(correct.shape[0], 1, dtype=torch.long), run[:, :-1]], dim=1)
    num, den = run.sum(0).tolist(), reached.sum(0).tolist()
    return [n / d if d else 0.0 for n, d in zip(num, den)]


def chain_starts(pos: list[int], runs: list[int], k: int) -> list[int]:
    """Indices into `pos` of the chain starts greedy speculative decoding with k drafts visits.

    pos: text positions (ascending) where a chain can start (the next token was generated);
    runs: the leading run of right draft steps at each. From the first start, a chain at t
    emits min(run, k) accepted drafts + the target's bonus token, so the next chain starts at
    t + min(run, k) + 1 (or at the next possible start after it: a gap is a prompt the engine
    prefills).
    """
    where = {t: i for i, t in enumerate(pos)}
    out, i = [], 0 if pos else None
    while i is not None:
        out.append(i)
        nxt = pos[i] + min(runs[i], k) + 1
        i = where.get(nxt)
        if i is None:
            i = next((j for j in range(out[-1] + 1, len(pos)) if pos[j] > nxt), None)
    return out


class HoldoutEval:
    """Teacher-forced evaluation of a draft on held-out sequences (no grad, greedy), from
    `evaluate_holdout`.

    acc: `steps` floats in [0, 1], the unconditional top-1 agreement per TTT step j (step j right
    regardless of steps < j), over rows whose target token at that step is learnable (`valid`);
    what the loss optimises, not an acceptance.
    positions: number of rows where a chain can start (the next token was generated); 0 when
    nothing was evaluated (then `acc` is empty and `simulated_tau` is None).
    Per-chain outcomes are kept per sequence so that `conditional(k)` / `simulated_tau(k)` follow
    the chain starts greedy speculative decoding at k visits (`chain_starts`): tokens per verify
    step is a ratio over the chains the engine runs, which weighs positions differently from a
    mean over every position (a stretch the draft gets right is crossed in one chain of k+1
    tokens, a stretch it gets wrong takes one chain per token).
    """

    def __init__(self, acc: list[float], steps: int, seqs: list[tuple[list[int], torch.Tensor]] = ()):
        self.acc = list(acc)
        self.steps = steps
        self._seqs = list(seqs)  # per sequence: (chain-start positions, right `[n, steps]` bool)
        self.positions = sum(len(p) for p, _ in self._seqs)

    def _rows(self, k: int) -> torch.Tensor:
        rows = []
        for pos, right in self._seqs:
            runs = torch.cumprod(right[:, :k].long(), 1).sum(1).tolist()
            rows.append(right[chain_starts(pos, runs, k), :k])
        return torch.cat(rows) if rows else torch.zeros(0, k, dtype=torch.bool)

    def conditional(self, k: int | None = None) -> list[float]:
        """Conditional acceptance a_j (j < k; k defaults to, and is capped at, the TTT steps):
        P(draft step j right | steps 0..j-1 right), over the chain starts visited at k. Empty
        when nothing was evaluated."""
        k = self.steps if k is None else min(k, self.steps)
        return conditional_acceptance(self._rows(k)) if self.positions and k > 0 else []

    def chains(self, k: int | None = None) -> int:
        """Number of chains (verify steps) greedy speculative decoding at k runs on these sequences."""
        k = self.steps if k is None else min(k, self.steps)
        return int(self._rows(k).shape[0]) if self.positions else 0

    def every_position_tau(self, k: int | None = None) -> float | None:
        """1 + the mean leading run of right drafts (≤ k) with a chain started at *every* position
        where one can start: the same positions whatever the draft, so two drafts compared on one
        record are paired position by position (`simulated_tau` weighs the chains each draft's own
        acceptance visits). Tokens per verify step, in [1, 1 + k]; None when nothing was evaluated."""
        k = self.steps if k is None else min(k, self.steps)
        if not self.positions:
            return None
        runs = torch.cat([torch.cumprod(right[:, :k].long(), 1).sum(1) for _, right in self._seqs])
        return 1.0 + float(runs.float().mean())

    def simulated_tau(self, k: int | None = None) -> float | None:
        """Simulated acceptance length at k drafts (k defaults to, and is capped at, the TTT
        steps): τ = 1 + Σ_{i<k} Π_{j≤i} a_j with a_j = `conditional(k)`, i.e. 1 + the mean leading
        run of right drafts (≤ k) over the chains greedy speculative decoding runs: tokens per
        target verify step, in [1, 1 + k]. None when nothing was evaluated. Drafts past the end
        of a sequence count as rejected (the holdout cannot score them)."""
        return simulated_acceptance_length(self.conditional(k)) if self.positions else None

    def val_metrics(self) -> dict:
        """The validation figures a training run reports (k = the TTT steps), none without a
        usable record: `val/acc_{j}` (`acc`), `val/cond_acc_{j}` (`conditional()`), `val_positions`."""
        if not self.positions:
            return {}
        return ({f"val/acc_{j}": a for j, a in enumerate(self.acc)}
                | {f"val/cond_acc_{j}": a for j, a in enumerate(self.conditional())}
                | {"val_positions": self.positions})


def evaluate_holdout(draft: Eagle3Draft, examples: list[Example], steps: int, batch_tokens: int) -> HoldoutEval:
    """Teacher-forced `HoldoutEval` of `draft` over prepared `examples` (`steps` TTT steps,
    batched by `batch_tokens` tokens), no grad; `evaluate_chunks` on one chunk.

    TTT step j at row t (EAGLE-3, arXiv 2503.01840 §3: training-time test) is the draft's (j+1)-th
    chained token after position t, fed the record's tokens t+1..t+1+j (teacher forcing). Where
    steps < j were right and the records are the target's own greedy outputs, those tokens are
    exactly the draft's own chain, so the outcome at a chain start is the outcome greedy
    speculative decoding has there (up to rounding: captured hidden states are bf16). A target
    token outside the draft vocab is a wrong step (the draft cannot propose it)."""
    return evaluate_chunks(draft, [examples], steps, batch_tokens)


def evaluate_chunks(draft: Eagle3Draft, chunks: Iterable[list[Example]], steps: int, batch_tokens: int) -> HoldoutEval:
    """`evaluate_holdout` over examples that arrive in chunks (`stream.ExampleStream.chunks`: one
    buffer in memory at a time); the outcomes are per row (`models.ttt.ttt_outcomes`), so chunking
    does not change them."""
    outcomes = ttt_outcomes(draft, chunks, steps, batch_tokens)
    return HoldoutEval(*outcomes)


def holdout_accuracy(draft: Eagle3Draft, target: Target, records: list[dict], tparams: TrainParams) -> HoldoutEval:
    """`evaluate_holdout` on capture records (generated positions only; prepared with the draft's
    vocab; `tparams.ttt_steps` steps). `.acc`: unconditional accuracy per step (log as
    `val/acc_{j}`); `.conditional(k)`: conditional acceptance (`val/cond_acc_{j}`);
    `.simulated_tau(k)`: the simulated τ at k drafts, None when no record is usable (then `.acc`
    and `.conditional()` are empty)."""
    examples = prepare(records, target, draft.t2d, tparams.max_seq_len)
    outcomes = ttt_outcomes(draft, [examples], tparams.ttt_steps, tparams.batch_tokens)
    return HoldoutEval(*outcomes)


def checkpoint_accuracy(path: Path, target: Target, records: list[dict], tparams: TrainParams) -> HoldoutEval:
    """`holdout_accuracy` of the draft saved in `path` (config.json + model.safetensors), loaded
    on the CPU in fp32 with the target's embedding, in eval mode. Raises as
    `models.eagle3.load_checkpoint` (ValueError for another target's draft)."""
    draft = load_checkpoint(path, target.embed.float().cpu(), target.target_id).eval()
    return holdout_accuracy(draft, target, records, tparams)


def record_taus(draft: Eagle3Draft, target: Target, records: list[dict], tparams: TrainParams,
                k: int) -> list[float | None]:
    """Per record, `HoldoutEval.every_position_tau(k)` of `draft` teacher-forced on it (`evaluate_holdout`
    on that record alone; generated positions only); None for a record with no usable position. What the
    draft-health guard compares two versions with, record by record (`serve.judge`). k ≥ 1: the
    evaluation runs k TTT steps (the engine's num_draft_tokens), whatever `tparams.ttt_steps` says."""
    out: list[float | None] = []
    for r in records:
        ex = prepare([r], target, draft.t2d, tparams.max_seq_len)
        out.append(evaluate_holdout(draft, ex, k, tparams.batch_tokens).every_position_tau(k) if ex else None)
    return out
