"""Embedded EAGLE3 trainer (CPU): training-time test over captured hidden states.

Loss (SpecForge `specforge/core/loss.py::_compute_loss`, `training/strategies/base.py`):
L = Σ_j decay^j · L_j, L_j = mean over valid positions of −Σ_v p_target(v) · log q_draft(v), where
p_target = softmax of the target's logits restricted to the draft vocab (t2d), from the captured
final hidden state through the target's lm_head; positions whose target argmax is outside the draft
vocab are dropped. Per-position accuracy acc_j (argmax agreement at TTT step j) gives the
simulated acceptance length 1 + Σ_k Π_{j≤k} acc_j.
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
from ..models.eagle3 import (Eagle3Config, Eagle3Draft, build_vocab, count_tokens, load_checkpoint,
                             remap_lm_head, save_checkpoint)
from ..models.target import Target
from .resume import clear_state, fingerprint, load_state, records_fingerprint, save_state, state_dir, weights_digest


@dataclass
class Example:
    """One training sequence: aux `[T, 3H]` fp32, ids `[T]` int64, target logits over the draft
    vocab `[T, Vd]` bf16, valid `[T]` bool (generated position whose target argmax is in-vocab)."""

    aux: torch.Tensor
    ids: torch.Tensor
    tlogits: torch.Tensor
    valid: torch.Tensor


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
                           full[:, cols].to(torch.bfloat16), valid))
    return out


def batches(examples: list[Example], max_tokens: int, shuffle: bool, rng: random.Random):
    """Length-bucketed padded batches of at most `max_tokens` (B·T_max) tokens."""
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
    for g in groups:
        ex = [examples[i] for i in g]
        T = max(e.ids.shape[0] for e in ex)
        pad = lambda t, v=0: F.pad(t, (0, 0) * (t.dim() - 1) + (0, T - t.shape[0]), value=v)  # noqa: E731
        yield (torch.stack([pad(e.aux) for e in ex]), torch.stack([pad(e.ids) for e in ex]),
               torch.stack([pad(e.tlogits) for e in ex]), torch.stack([pad(e.valid, False) for e in ex]),
               torch.stack([pad(torch.ones(e.ids.shape[0], dtype=torch.bool), False) for e in ex]))


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


def evaluate_examples(draft, examples, steps, batch_tokens) -> list[float]:
    """Teacher-forced accuracy per TTT step (argmax agreement with the target, in [0, 1]; `steps`
    values) over prepared `examples`, batched by `batch_tokens`; no grad."""
    corr, cnt = [0] * steps, [0] * steps
    with torch.no_grad():
        for aux, ids, tl, valid, kv in batches(examples, batch_tokens, False, random.Random(0)):
            _, c, n = ttt_loss(draft, aux, ids, tl, valid, kv, steps, 1.0)
            corr = [a + b for a, b in zip(corr, c)]
            cnt = [a + b for a, b in zip(cnt, n)]
    return [c / n if n else 0.0 for c, n in zip(corr, cnt)]


def holdout_accuracy(draft: Eagle3Draft, target: Target, records: list[dict], tparams: TrainParams) -> list[float]:
    """`evaluate_examples` on capture records (generated positions only; prepared with the draft's
    vocab). Returns `tparams.ttt_steps` accuracies, empty when no record is usable."""
    ex = prepare(records, target, draft.t2d, tparams.max_seq_len)
    return evaluate_examples(draft, ex, tparams.ttt_steps, tparams.batch_tokens) if ex else []


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
    uninterrupted run. Returns metrics (names per DESIGN.md): `train/loss` (per epoch list),
    `train/acc_{j}`, `val/acc_{j}`, `simulated_acceptance_length`, `train_tokens_per_s` (non-padding
    tokens per second of optimizer steps), `train_seconds`, `train_tokens`, `dropped/{reason}`,
    `val_dropped/{reason}`, `skipped_nonfinite_steps` (batches with a non-finite loss or nothing to
    learn), `resumed_from_step`. The resume fingerprint covers params, every record's tensors, the
    target (id, dtype, aux layers) and the warm start's weights. Raises ValueError for an empty
    training set, or when training diverged (non-finite weights; nothing is saved).
    """
    if not train_records:
        raise ValueError("no training records after curation; capture more traffic")
    batch_tokens = tparams.batch_tokens
    if tparams.threads:
        torch.set_num_threads(tparams.threads)
    counts = count_tokens([r["input_ids"] for r in train_records], [r["loss_mask"] for r in train_records])
    draft = init_draft(target, dparams, counts, init)
    draft.train()
    dropped: Counter = Counter()
    ex_train = prepare(train_records, target, draft.t2d, tparams.max_seq_len, tparams.loss_on_prompt, dropped)
    val_dropped: Counter = Counter()
    ex_val = prepare(val_records, target, draft.t2d, tparams.max_seq_len, dropped=val_dropped)
    if not ex_train:
        raise ValueError(f"every training record was dropped ({dict(dropped)}); capture more traffic")
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tparams.lr, weight_decay=tparams.weight_decay)
    nb = sum(1 for _ in batches(ex_train, batch_tokens, False, random.Random(0)))
    total = max(1, nb * tparams.epochs)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, total // 20)) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    rng = random.Random(tparams.seed)
    torch.manual_seed(tparams.seed)
    steps = tparams.ttt_steps
    sdir = state_dir(out)
    fp = fingerprint(tparams.model_dump(exclude={"threads"}), dparams.model_dump(), weights_digest(init),
                     target.target_id, str(target.dtype), list(target.aux_layers), records_fingerprint(train_records))
    st = load_state(sdir, fp)
    run = {"step": 0, "epoch": 0, "batches_done": 0, "losses": [], "tokens": 0, "seconds": 0.0, "skipped": 0,
           "ep_loss": 0.0, "ep_n": 0, "corr": [0] * steps, "cnt": [0] * steps, "epoch_rng": rng.getstate()}
    resumed_from = 0
    if st is not None:
        draft.load_state_dict(st["draft"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        run = st["run"]
        resumed_from = run["step"]

    def checkpoint():
        save_state(sdir, {"fingerprint": fp, "draft": draft.state_dict(), "opt": opt.state_dict(),
                          "sched": sched.state_dict(), "run": run})

    every = tparams.checkpoint_every
    for ep in range(run["epoch"], tparams.epochs):
        rng.setstate(run["epoch_rng"])  # the epoch's batch order, reproducible on resume
        t0 = time.perf_counter()
        for bi, (aux, ids, tl, valid, kv) in enumerate(batches(ex_train, batch_tokens, True, rng)):
            if bi < run["batches_done"]:
                continue
            loss, c, n = ttt_loss(draft, aux, ids, tl, valid, kv, steps, tparams.loss_decay)
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
        checkpoint()
    draft.eval()
    if not all(torch.isfinite(p).all() for p in params):
        raise ValueError(f"training diverged (non-finite weights; lr {tparams.lr}); nothing saved, lower train.lr")
    train_acc = run.get("last_train_acc", [0.0] * steps)
    val_acc = evaluate_examples(draft, ex_val, steps, batch_tokens) if ex_val else train_acc
    secs = run["seconds"]
    metrics = {"train/loss": run["losses"], "train_seconds": secs,
               "train_tokens_per_s": run["tokens"] / secs if secs else 0.0, "train_tokens": run["tokens"],
               "simulated_acceptance_length": simulated_acceptance_length(val_acc),
               "train_examples": len(ex_train), "val_examples": len(ex_val),
               "skipped_nonfinite_steps": run["skipped"], "resumed_from_step": resumed_from,
               "curve": run.get("curve", [])}
    metrics.update({f"dropped/{k}": v for k, v in dropped.items()})
    metrics.update({f"val_dropped/{k}": v for k, v in val_dropped.items()})
    metrics.update({f"train/acc_{j}": a for j, a in enumerate(train_acc)})
    metrics.update({f"val/acc_{j}": a for j, a in enumerate(val_acc)})
    save_checkpoint(draft, out, extra={"warm_start": str(init) if init else None})
    (Path(out) / "train_metrics.json").write_text(json.dumps(metrics, indent=2))
    clear_state(sdir)
    return metrics
