"""Embedded EAGLE3 trainer (CPU): training-time test over captured hidden states.

Loss (SpecForge `specforge/core/loss.py::_compute_loss`, `training/strategies/base.py`):
L = Σ_j decay^j · L_j, L_j = mean over valid positions of −Σ_v p_target(v) · log q_draft(v), where
p_target = softmax of the target's logits restricted to the draft vocab (t2d), from the captured
final hidden state through the target's lm_head; positions whose target argmax is outside the draft
vocab are dropped.

Holdout evaluation (`evaluate_holdout`, teacher-forced, no sampling): TTT step j at row t is the
draft's (j+1)-th chained token after position t (EAGLE-3, arXiv 2503.01840 §3, training-time
test). Two figures per step j: `acc_j`, the unconditional top-1 agreement (step j right, whatever
steps < j did; what the loss optimises, logged as `val/acc_{j}`), and the conditional acceptance
a_j = P(step j right | steps 0..j-1 right at the same chain start) (`val/cond_acc_{j}`), taken
over the chain starts greedy speculative decoding visits. Only the conditional one gives the
simulated acceptance length τ = 1 + Σ_{i<k} Π_{j≤i} a_j (= 1 + mean leading run of right steps,
capped at k), the τ greedy speculative decoding with k drafts measures on the same text (tested
against an engine replay); Π acc_j is not that (errors at consecutive steps are correlated).

One file (~460 lines): the TTT loop, its loss and the holdout evaluation (unconditional accuracy,
conditional acceptance over the chains greedy decoding visits, simulated τ) share one unroll.
"""
from __future__ import annotations

import json
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..config import DraftParams, TrainParams
from ..engine.stats import simulated_acceptance_length
from ..models.eagle3 import Eagle3Config, Eagle3Draft, build_vocab, count_tokens, load_checkpoint, remap_lm_head, save_checkpoint
from ..models.target import Target
from .resume import clear_state, fingerprint, load_state, records_fingerprint, save_state, state_dir, weights_digest


@dataclass
class Example:
    """One training sequence: aux `[T, 3H]` fp32, ids `[T]` int64, target logits over the draft
    vocab `[T, Vd]` bf16, valid `[T]` bool (learnable position: kept by the loss mask, and its
    target argmax is in the draft vocab), keep `[T]` bool (kept by the loss mask, whatever the
    argmax: the positions a draft is evaluated on; None = same as valid)."""

    aux: torch.Tensor
    ids: torch.Tensor
    tlogits: torch.Tensor
    valid: torch.Tensor
    keep: torch.Tensor | None = None


def prepare(records: list[dict], target: Target, t2d: torch.Tensor, max_len: int,
            loss_on_prompt: bool = False, dropped: Counter | None = None) -> list[Example]:
    """Turn capture records into examples (target logits computed once, restricted to the draft vocab).

    `loss_on_prompt`: also learn the target's distribution at prompt positions (loss_mask == 0).
    SpecForge masks them; on small captures they are extra in-domain signal for free.
    Records with NaN/Inf hidden states, shorter than 3 tokens, or without a position to learn
    (all cut off by `max_len`, or every target argmax outside the draft vocab) are dropped and
    counted in `dropped` (keys `non_finite`, `too_short`, `no_valid_positions`).
    """
    out = []
    dropped = Counter() if dropped is None else dropped
    cols = t2d.nonzero().squeeze(-1)
    for r in records:
        T = min(int(r["input_ids"].shape[0]), max_len)
        if T < 3:
            dropped["too_short"] += 1
            continue
        if not (torch.isfinite(r["hidden_states"][:T]).all() and torch.isfinite(r["aux_hidden_states"][:T]).all()):
            dropped["non_finite"] += 1
            continue
        hid = r["hidden_states"][:T].float()
        with torch.no_grad():
            full = target.logits_from_hidden(hid)  # [T, V]
        keep = torch.ones(T, dtype=torch.bool) if loss_on_prompt else r["loss_mask"][:T].bool()
        valid = keep & t2d[full.argmax(-1)]
        if not valid[1:].any():  # nothing to learn (e.g. generation cut off by max_len, or out of vocab)
            dropped["no_valid_positions"] += 1
            continue
        out.append(Example(r["aux_hidden_states"][:T].float(), r["input_ids"][:T].long(),
                           full[:, cols].to(torch.bfloat16), valid, keep))
    return out


def _groups(examples: list[Example], max_tokens: int, shuffle: bool, rng: random.Random) -> list[list[int]]:
    order = sorted(range(len(examples)), key=lambda i: examples[i].ids.shape[0])
    groups, cur = [], []
    for i in order:
        t = examples[i].ids.shape[0]
        if cur and (len(cur) + 1) * t > max_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    if shuffle:
        rng.shuffle(groups)
    return groups


def _pad(t: torch.Tensor, T: int, v=0) -> torch.Tensor:
    return F.pad(t, (0, 0) * (t.dim() - 1) + (0, T - t.shape[0]), value=v)


def batches(examples: list[Example], max_tokens: int, shuffle: bool, rng: random.Random):
    """Length-bucketed padded batches of at most `max_tokens` (B·T_max) tokens: (aux `[B,T,3H]`,
    ids `[B,T]`, tlogits `[B,T,Vd]`, valid `[B,T]`, key_valid `[B,T]` (not padding))."""
    for g in _groups(examples, max_tokens, shuffle, rng):
        ex = [examples[i] for i in g]
        T = max(e.ids.shape[0] for e in ex)
        yield (torch.stack([_pad(e.aux, T) for e in ex]), torch.stack([_pad(e.ids, T) for e in ex]),
               torch.stack([_pad(e.tlogits, T) for e in ex]), torch.stack([_pad(e.valid, T, False) for e in ex]),
               torch.stack([_pad(torch.ones(e.ids.shape[0], dtype=torch.bool), T, False) for e in ex]))


def ttt_loss(draft: Eagle3Draft, aux, ids, tlogits, valid, key_valid, steps: int, decay: float):
    """Returns (loss, [correct_j], [count_j]) for one padded batch.

    aux `[B,T,3H]`, ids `[B,T]`, tlogits `[B,T,Vd]`, valid/key_valid `[B,T]` bool.
    Step j row t is trained on the target distribution at position t+1+j. As SpecForge
    (`core/loss.py`), L_j sums the cross-entropy over step j's valid rows and divides by all
    (non-padding) positions, so later steps, with fewer valid rows, weigh less.
    """
    hs = draft.ttt_forward(aux, ids, steps, key_valid)
    loss = torch.zeros(())
    denom = max(int(key_valid.sum()), 1)
    correct, count = [], []
    for j, h in enumerate(hs):
        tl = F.pad(tlogits[:, 1 + j:], (0, 0, 0, 1 + j))
        m = F.pad(valid[:, 1 + j:], (0, 1 + j), value=False)
        n = int(m.sum())
        if n == 0:
            correct.append(0)
            count.append(0)
            continue
        logits = draft.logits(h[m])  # only valid rows pay for the lm_head
        tp = torch.softmax(tl[m].float(), -1)
        lj = -(tp * torch.log_softmax(logits, -1)).sum() / denom
        loss = loss + decay ** j * lj
        correct.append(int((logits.argmax(-1) == tp.argmax(-1)).sum()))
        count.append(n)
    return loss, correct, count


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

    def simulated_tau(self, k: int | None = None) -> float | None:
        """Simulated acceptance length at k drafts (k defaults to, and is capped at, the TTT
        steps): τ = 1 + Σ_{i<k} Π_{j≤i} a_j with a_j = `conditional(k)`, i.e. 1 + the mean leading
        run of right drafts (≤ k) over the chains greedy speculative decoding runs: tokens per
        target verify step, in [1, 1 + k]. None when nothing was evaluated. Drafts past the end
        of a sequence count as rejected (the holdout cannot score them)."""
        return simulated_acceptance_length(self.conditional(k)) if self.positions else None


def evaluate_holdout(draft: Eagle3Draft, examples: list[Example], steps: int, batch_tokens: int) -> HoldoutEval:
    """Teacher-forced `HoldoutEval` of `draft` over prepared `examples` (`steps` TTT steps,
    batched by `batch_tokens` tokens), no grad.

    TTT step j at row t (EAGLE-3, arXiv 2503.01840 §3: training-time test) is the draft's (j+1)-th
    chained token after position t, fed the record's tokens t+1..t+1+j (teacher forcing). Where
    steps < j were right and the records are the target's own greedy outputs, those tokens are
    exactly the draft's own chain, so the outcome at a chain start is the outcome greedy
    speculative decoding has there (up to rounding: captured hidden states are bf16). A target
    token outside the draft vocab is a wrong step (the draft cannot propose it)."""
    corr, cnt = [0] * steps, [0] * steps
    seqs: list[tuple[list[int], torch.Tensor]] = []
    with torch.no_grad():
        for g in _groups(examples, batch_tokens, False, random.Random(0)):
            ex = [examples[i] for i in g]
            T = max(e.ids.shape[0] for e in ex)
            aux = torch.stack([_pad(e.aux, T) for e in ex])
            ids = torch.stack([_pad(e.ids, T) for e in ex])
            tl = torch.stack([_pad(e.tlogits, T) for e in ex])
            valid = torch.stack([_pad(e.valid, T, False) for e in ex])
            keep = torch.stack([_pad(e.valid if e.keep is None else e.keep, T, False) for e in ex])
            kv = torch.stack([_pad(torch.ones(e.ids.shape[0], dtype=torch.bool), T, False) for e in ex])
            hs = draft.ttt_forward(aux, ids, steps, kv)
            right = []
            for j, h in enumerate(hs):
                m = F.pad(valid[:, 1 + j:], (0, 1 + j), value=False)  # step j's target position is learnable
                tgt = F.pad(tl[:, 1 + j:], (0, 0, 0, 1 + j))
                r = torch.zeros_like(m)
                if m.any():
                    r[m] = draft.logits(h[m]).argmax(-1) == tgt[m].float().argmax(-1)
                corr[j] += int(r.sum())
                cnt[j] += int(m.sum())
                right.append(r)
            right_ = torch.stack(right, -1)  # [B, T, steps]
            start = F.pad(keep[:, 1:], (0, 1), value=False)  # rows whose next token was generated
            for b in range(len(ex)):
                pos = start[b].nonzero().squeeze(-1)
                if pos.numel():
                    seqs.append((pos.tolist(), right_[b, pos]))
    if not seqs:
        return HoldoutEval([], steps)
    return HoldoutEval([a / n if n else 0.0 for a, n in zip(corr, cnt)], steps, seqs)


def evaluate_examples(draft, examples, steps, batch_tokens) -> list[float]:
    """Unconditional teacher-forced accuracy per TTT step (`evaluate_holdout(...).acc`: argmax
    agreement with the target at step j whatever steps < j did, in [0, 1]; `steps` values, empty
    when nothing was evaluated). Not a per-position acceptance: for τ use `evaluate_holdout`."""
    return evaluate_holdout(draft, examples, steps, batch_tokens).acc


def holdout_accuracy(draft: Eagle3Draft, target: Target, records: list[dict], tparams: TrainParams) -> HoldoutEval:
    """`evaluate_holdout` on capture records (generated positions only; prepared with the draft's
    vocab; `tparams.ttt_steps` steps). `.acc`: unconditional accuracy per step (log as
    `val/acc_{j}`); `.conditional(k)`: conditional acceptance (`val/cond_acc_{j}`);
    `.simulated_tau(k)`: the simulated τ at k drafts, None when no record is usable (then `.acc`
    and `.conditional()` are empty)."""
    ex = prepare(records, target, draft.t2d, tparams.max_seq_len)
    return evaluate_holdout(draft, ex, tparams.ttt_steps, tparams.batch_tokens) if ex else HoldoutEval([], tparams.ttt_steps)


def init_draft(target: Target, dparams: DraftParams, counts, init: Path | None) -> Eagle3Draft:
    """New draft (lm_head rows from the target's) or warm start from `init`, remapped to the new vocab."""
    cfg = Eagle3Config.for_target(target.cfg, target.aux_layers, dparams.draft_vocab_size,
                                  dparams.intermediate_size, target.target_id)
    d2t, t2d = build_vocab(counts, cfg.draft_vocab_size, cfg.vocab_size)
    head = target.lm_head_weight.float()
    if init is not None:
        draft = load_checkpoint(init, target.embed.float(), target.target_id)
        if draft.config.draft_vocab_size != cfg.draft_vocab_size:
            raise ValueError(f"warm start {init} has draft_vocab_size {draft.config.draft_vocab_size}, "
                             f"params say {cfg.draft_vocab_size}; set train.warm_start: false to retrain")
        remap_lm_head(draft, d2t, t2d, head)
        return draft
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    draft.set_embed(target.embed.float())
    remap_lm_head(draft, d2t, t2d, head)
    return draft


def train_draft(train_records: list[dict], val_records: list[dict], target: Target, dparams: DraftParams,
                tparams: TrainParams, out: Path, init: Path | None = None,
                progress: Callable[[int, int, float], None] | None = None,
                on_epoch: Callable[[int, Eagle3Draft], dict] | None = None) -> dict:
    """Train (or warm-start) a draft and save it to `out` (config.json + model.safetensors + train_metrics.json).

    `on_epoch(epoch, draft)` runs after each epoch (draft in eval mode, no grad); its dicts are
    returned in order as metrics["curve"] (benchmarks log learning curves with it).

    Resumable: the training state (weights, AdamW, LR schedule, epoch, batch, RNG) is saved every
    `train.checkpoint_every` optimizer steps and at each epoch end under `<out>.train-state/`; a rerun
    with the same data, params and warm start continues from it and gives the same weights as an
    uninterrupted run. Returns metrics (the names MLflow gets; docs/orchestration.md): `train/loss` (per epoch list),
    `train/acc_{j}` (last epoch, unconditional), and on the validation records (`evaluate_holdout`;
    all absent when no validation record is usable, never the training accuracy under `val/`):
    `val/acc_{j}` (unconditional top-1 agreement at TTT step j), `val/cond_acc_{j}` (conditional
    acceptance a_j at k = ttt_steps), `val_positions`; `simulated_acceptance_length` (1 + Σ_i Π_{j≤i}
    a_j at k = ttt_steps, `HoldoutEval.simulated_tau`; None without validation records),
    `train_tokens_per_s` (non-padding
    tokens per second of optimizer steps), `train_seconds`, `train_tokens`, `dropped/{reason}`,
    `val_dropped/{reason}`, `skipped_nonfinite_steps` (batches with a non-finite loss or nothing to
    learn), `resumed_from_step`. The resume fingerprint covers params, every record's tensors, the
    target (id, dtype, aux layers) and the warm start's weights. Raises ValueError for an empty
    training set, or when training diverged (non-finite weights; nothing is saved).
    """
    if not train_records:
        raise ValueError("no training records after curation; capture more traffic")
    if tparams.threads:
        torch.set_num_threads(tparams.threads)
    counts = count_tokens([r["input_ids"] for r in train_records], [r["loss_mask"] for r in train_records])
    draft = init_draft(target, dparams, counts, init)
    draft.train()
    dropped, val_dropped = Counter(), Counter()
    ex_train = prepare(train_records, target, draft.t2d, tparams.max_seq_len, tparams.loss_on_prompt, dropped)
    ex_val = prepare(val_records, target, draft.t2d, tparams.max_seq_len, dropped=val_dropped)
    if not ex_train:
        raise ValueError(f"every training record was dropped ({dict(dropped)}); capture more traffic")
    params = [p for p in draft.parameters() if p.requires_grad]
    opt, sched, total = _optimizer(params, ex_train, tparams)
    rng = random.Random(tparams.seed)
    torch.manual_seed(tparams.seed)
    sdir = state_dir(out)
    fp = fingerprint(tparams.model_dump(exclude={"threads"}), dparams.model_dump(), weights_digest(init),
                     target.target_id, str(target.dtype), list(target.aux_layers), records_fingerprint(train_records))
    run, resumed_from = _resume(sdir, fp, draft, opt, sched, tparams.ttt_steps, rng)

    def checkpoint():
        save_state(sdir, {"fingerprint": fp, "draft": draft.state_dict(), "opt": opt.state_dict(),
                          "sched": sched.state_dict(), "run": run})

    for ep in range(run["epoch"], tparams.epochs):
        _train_epoch(draft, opt, sched, params, ex_train, tparams, rng, run, total, progress, checkpoint)
        _end_epoch(draft, run, ep, rng, tparams.ttt_steps, on_epoch)
        checkpoint()
    draft.eval()
    if not all(torch.isfinite(p).all() for p in params):
        raise ValueError(f"training diverged (non-finite weights; lr {tparams.lr}); nothing saved, lower train.lr")
    metrics = _metrics(draft, ex_train, ex_val, run, tparams, resumed_from, dropped, val_dropped)
    save_checkpoint(draft, out, extra={"warm_start": str(init) if init else None})
    (Path(out) / "train_metrics.json").write_text(json.dumps(metrics, indent=2))
    clear_state(sdir)
    return metrics


def _optimizer(params: list, ex_train: list, tparams: TrainParams):
    """AdamW + linear warm-up (5 % of the steps) then cosine decay over every epoch's batches.
    Returns (optimizer, scheduler, total optimizer steps)."""
    opt = torch.optim.AdamW(params, lr=tparams.lr, weight_decay=tparams.weight_decay)
    nb = sum(1 for _ in batches(ex_train, tparams.batch_tokens, False, random.Random(0)))
    total = max(1, nb * tparams.epochs)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, total // 20)) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    return opt, sched, total


def _resume(sdir: Path, fp: str, draft, opt, sched, steps: int, rng: random.Random) -> tuple[dict, int]:
    """The run state: a fresh one, or the saved one (weights, optimizer and schedule loaded into
    `draft`, `opt`, `sched`) when `sdir` holds a state with fingerprint `fp`. Returns (run, resumed step)."""
    run = {"step": 0, "epoch": 0, "batches_done": 0, "losses": [], "tokens": 0, "seconds": 0.0, "skipped": 0,
           "ep_loss": 0.0, "ep_n": 0, "corr": [0] * steps, "cnt": [0] * steps, "epoch_rng": rng.getstate()}
    st = load_state(sdir, fp)
    if st is None:
        return run, 0
    draft.load_state_dict(st["draft"])
    opt.load_state_dict(st["opt"])
    sched.load_state_dict(st["sched"])
    return st["run"], st["run"]["step"]


def _train_epoch(draft, opt, sched, params: list, ex_train: list, tparams: TrainParams, rng: random.Random,
                 run: dict, total: int, progress, checkpoint) -> None:
    """One epoch of TTT steps (EAGLE-3 §3.2 training-time test) over `ex_train`, from batch
    `run["batches_done"]` on (a resumed epoch skips what it did); updates `run` in place and
    checkpoints every `train.checkpoint_every` optimizer steps."""
    rng.setstate(run["epoch_rng"])  # the epoch's batch order, reproducible on resume
    every, t0 = tparams.checkpoint_every, time.perf_counter()
    for bi, (aux, ids, tl, valid, kv) in enumerate(batches(ex_train, tparams.batch_tokens, True, rng)):
        if bi < run["batches_done"]:
            continue
        loss, c, n = ttt_loss(draft, aux, ids, tl, valid, kv, tparams.ttt_steps, tparams.loss_decay)
        run["batches_done"] = bi + 1
        if not loss.requires_grad or not torch.isfinite(loss):  # nothing to learn / a bad batch
            run["skipped"] += 1
            continue
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        run["step"] += 1
        run["tokens"] += int(kv.sum())
        run["ep_loss"] += float(loss.detach())
        run["ep_n"] += 1
        run["corr"] = [a + b for a, b in zip(run["corr"], c)]
        run["cnt"] = [a + b for a, b in zip(run["cnt"], n)]
        if progress:
            progress(run["step"], total, float(loss.detach()))
        if every and run["step"] % every == 0:
            run["seconds"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            checkpoint()
    run["seconds"] += time.perf_counter() - t0


def _end_epoch(draft, run: dict, ep: int, rng: random.Random, steps: int, on_epoch) -> None:
    """Close epoch `ep` in `run` (mean loss, training accuracy, next epoch's batch order) and log
    `on_epoch(ep + 1, draft)` to the learning curve (draft in eval mode, no grad)."""
    train_acc = [c / n if n else 0.0 for c, n in zip(run["corr"], run["cnt"])]
    run["losses"].append(run["ep_loss"] / max(run["ep_n"], 1))
    run.update(epoch=ep + 1, batches_done=0, ep_loss=0.0, ep_n=0, corr=[0] * steps, cnt=[0] * steps,
               epoch_rng=rng.getstate(), last_train_acc=train_acc)
    if on_epoch:
        draft.eval()
        with torch.no_grad():
            run.setdefault("curve", []).append({"epoch": ep + 1, "train_tokens": run["tokens"],
                                                "train_seconds": run["seconds"], **on_epoch(ep + 1, draft)})
        draft.train()


def _metrics(draft, ex_train: list, ex_val: list, run: dict, tparams: TrainParams, resumed_from: int,
             dropped: Counter, val_dropped: Counter) -> dict:
    """The metrics `train_draft` returns (its docstring names them), with the holdout evaluation."""
    steps = tparams.ttt_steps
    train_acc = run.get("last_train_acc", [0.0] * steps)
    ev = evaluate_holdout(draft, ex_val, steps, tparams.batch_tokens) if ex_val else HoldoutEval([], steps)
    secs = run["seconds"]
    metrics = {"train/loss": run["losses"], "train_seconds": secs,
               "train_tokens_per_s": run["tokens"] / secs if secs else 0.0, "train_tokens": run["tokens"],
               "simulated_acceptance_length": ev.simulated_tau(),
               "train_examples": len(ex_train), "val_examples": len(ex_val),
               "skipped_nonfinite_steps": run["skipped"], "resumed_from_step": resumed_from,
               "curve": run.get("curve", [])}
    metrics.update({f"dropped/{k}": v for k, v in dropped.items()})
    metrics.update({f"val_dropped/{k}": v for k, v in val_dropped.items()})
    metrics.update({f"train/acc_{j}": a for j, a in enumerate(train_acc)})
    if ev.positions:
        metrics.update({f"val/acc_{j}": a for j, a in enumerate(ev.acc)})
        metrics.update({f"val/cond_acc_{j}": a for j, a in enumerate(ev.conditional())})
        metrics["val_positions"] = ev.positions
    return metrics
