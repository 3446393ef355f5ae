"""The embedded EAGLE3 trainer: training-time test (TTT) over captured hidden states (`train_draft`).

Loss (`models.ttt.ttt_loss`, as SpecForge `specforge/core/loss.py::_compute_loss`): L = Σ_j decay^j · L_j,
L_j the mean over valid positions of −Σ_v p_target(v) · log q_draft(v) (`train.loss: kl`; `lk`: −log Σ_v
min(p_target(v), q_draft(v)), LK losses, arXiv 2602.23881), p_target the target's distribution
restricted to the draft vocabulary, from the captured final hidden state through its lm_head; positions
whose target argmax is outside the draft vocabulary are dropped. Warm start from a draft (its vocabulary
remapped), resumable state every `checkpoint_every` steps, the holdout evaluated per epoch
(`train.holdout`). Device: `train.device` (the draft, its optimizer and each batch); precision:
`train.precision` (bfloat16 autocast over float32 weights, the default on CUDA; CPU trains in float32).
More: docs/design/train.md.
"""
from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from ..config import DraftParams, TrainParams
from ..models.device import resolve_training
from ..models.eagle3 import (
    Eagle3Config,
    Eagle3Draft,
    build_vocab,
    load_checkpoint,
    remap_lm_head,
    save_checkpoint,
)
from ..models.target import Target
from ..models.ttt import ttt_loss
from . import ranks
from .holdout import HoldoutEval, evaluate_chunks
from .resume import clear_state, fingerprint, load_state, save_state, state_dir, weights_digest
from .source import RecordSource, as_source
from .stream import ExampleStream, token_counts

log = logging.getLogger(__name__)


def init_draft(target: Target, dparams: DraftParams, counts, init: Path | None) -> Eagle3Draft:
    """New draft (lm_head rows from the target's) or warm start from `init`, remapped to the new
    vocab; on CPU (the caller places it: `Eagle3Draft.to_device`)."""
    cfg = Eagle3Config.for_target(target.cfg, target.aux_layers, dparams.draft_vocab_size,
                                  dparams.intermediate_size, target.target_id)
    d2t, t2d = build_vocab(counts, cfg.draft_vocab_size, cfg.vocab_size)
    head, embed = target.lm_head_weight.float().cpu(), target.embed.float().cpu()  # built on CPU, then placed
    if init is not None:
        draft = load_checkpoint(init, embed, target.target_id)
        if draft.config.draft_vocab_size != cfg.draft_vocab_size:
            raise ValueError(f"warm start {init} has draft_vocab_size {draft.config.draft_vocab_size}, "
                             f"params say {cfg.draft_vocab_size}; set train.warm_start: false to retrain")
        remap_lm_head(draft, d2t, t2d, head)
        return draft
    torch.manual_seed(0)
    draft = Eagle3Draft(cfg)
    draft.set_embed(embed)
    remap_lm_head(draft, d2t, t2d, head)
    return draft


def train_draft(train_records: RecordSource | list[dict], val_records: RecordSource | list[dict], target: Target,
                dparams: DraftParams, tparams: TrainParams, out: Path, init: Path | None = None,
                progress: Callable[[int, int, float], None] | None = None,
                on_epoch: Callable[[int, Eagle3Draft], dict] | None = None) -> dict:
    """Train (or warm-start) a draft and save it to `out` (config.json + model.safetensors + train_metrics.json).

    Records: a `RecordSource` (`IndexRecords`: a curated index's shards, read as needed) or a list
    of record dicts. They stream through a buffer of `train.buffer_mb` (`stream.ExampleStream`):
    a set that fits is prepared once and kept; a larger one is re-read each epoch, one buffer at a
    time, so memory does not grow with the set. Under torchrun (WORLD_SIZE > 1) each rank trains
    on its rows of every global batch and the gradients are summed (`ranks`): the same global
    batches, hence the same weights up to summation order, as one process; rank 0 writes the
    training state, the checkpoint and the metrics (other ranks return {"rank": r}).

    `on_epoch(epoch, draft)` runs after each epoch (draft in eval mode, no grad); its dicts are
    returned in order as metrics["curve"] (benchmarks log learning curves with it).

    Resumable: the training state (weights, AdamW, LR schedule, epoch, batch, RNG) is saved every
    `train.checkpoint_every` optimizer steps and at each epoch end under `<out>.train-state/`; a rerun
    with the same data, params and warm start continues from it (at any rank count) and gives the
    same weights as an uninterrupted run. Returns metrics (the names MLflow gets;
    docs/orchestration.md): `train/loss` (per epoch list),
    `train/acc_{j}` (last epoch, unconditional), and on the validation records (`evaluate_holdout`;
    all absent when no validation record is usable, never the training accuracy under `val/`):
    `val/acc_{j}` (unconditional top-1 agreement at TTT step j), `val/cond_acc_{j}` (conditional
    acceptance a_j at k = ttt_steps), `val_positions`; `simulated_acceptance_length` (1 + Σ_i Π_{j≤i}
    a_j at k = ttt_steps, `HoldoutEval.simulated_tau`; None without validation records),
    `train_tokens_per_s` (non-padding tokens per second of optimizer steps), `train_seconds`,
    `train_input_wait_seconds` (of those, waiting for batches: reading, preparing, copying),
    `train_tokens`, `train_steps` (optimizer steps), `dropped/{reason}`, `val_dropped/{reason}`,
    `skipped_nonfinite_steps` (batches with a non-finite loss or nothing to learn),
    `train_rejected_positions` (with `train.rejected_weight`: the learnable positions it weighed),
    `resumed_from_step`, `train_world_size`, `train_buffers` (buffers per epoch; 1: held in
    memory). The resume fingerprint covers params, the records' content, the
    target (id, dtype, aux layers) and the warm start's weights. Raises ValueError for an empty
    training set, or when training diverged (non-finite weights; nothing is saved).
    """
    src, val_src = as_source(train_records), as_source(val_records)
    if not len(src):
        raise ValueError("no training records after curation; capture more traffic")
    if tparams.threads:
        torch.set_num_threads(tparams.threads)
    dev, amp = resolve_training(tparams.device, tparams.precision)
    dev, rank, world = ranks.place(dev)
    draft = init_draft(target, dparams, token_counts(src, rank, world), init).to_device(dev)
    draft.train()
    dropped, val_dropped = Counter(), Counter()
    stream = ExampleStream(src, target, draft.t2d, tparams, dropped, rank, world)
    val = None
    if rank == 0:
        val = ExampleStream(val_src, target, draft.t2d, tparams, val_dropped, validation=True, collective=False)
    if not len(stream):
        raise ValueError(f"every training record was dropped ({dict(dropped)}); capture more traffic")
    if tparams.rejected_weight and not stream.weighted_positions and rank == 0:
        log.warning("train.rejected_weight %s weighs nothing here: no learnable position of the training records "
                    "is one where the serving draft was rejected (the embedded engine's capture records them; "
                    "endpoint, vLLM and SGLang traffic does not)", tparams.rejected_weight)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt, sched, total = _optimizer(params, stream, tparams)
    rng = random.Random(tparams.seed)
    torch.manual_seed(tparams.seed)
    sdir = state_dir(out)
    fp = fingerprint(tparams.learning_dump(), dparams.model_dump(), weights_digest(init),
                     target.target_id, str(target.dtype) if target.quantization == "none" else target.precision,
                     list(target.aux_layers), src.fingerprint(),
                     str(amp))  # the resolved precision: `auto` is bfloat16 on CUDA, float32 on CPU
    run, resumed_from = _resume(sdir, fp, draft, opt, sched, tparams.ttt_steps, rng)

    def checkpoint():
        if rank == 0:
            save_state(sdir, {"fingerprint": fp, "draft": draft.state_dict(), "opt": opt.state_dict(),
                              "sched": sched.state_dict(), "run": run})

    for ep in range(run["epoch"], tparams.epochs):
        _train_epoch(draft, opt, sched, params, stream, tparams, rng, run, total, progress, checkpoint, amp)
        _end_epoch(draft, run, ep, rng, tparams.ttt_steps, on_epoch if rank == 0 else None)
        if ep + 1 < tparams.epochs:  # after the last one the checkpoint below is saved and the state cleared
            checkpoint()
    draft.eval()
    if not all(torch.isfinite(p).all() for p in params):
        raise ValueError(f"training diverged (non-finite weights; lr {tparams.lr}); nothing saved, lower train.lr")
    if rank != 0:
        ranks.barrier()  # rank 0 saves; every rank returns once the checkpoint is there
        return {"rank": rank}
    metrics = _metrics(draft, stream, val, run, tparams, resumed_from, dropped, val_dropped)
    metrics |= {"train_device": str(dev), "train_precision": "bfloat16" if amp else "float32",
                "train_world_size": world}
    save_checkpoint(draft.to_device(torch.device("cpu")), out, extra={"warm_start": str(init) if init else None})
    (Path(out) / "train_metrics.json").write_text(json.dumps(metrics, indent=2))
    clear_state(sdir)
    ranks.barrier()
    return metrics


def _optimizer(params: list, stream: ExampleStream, tparams: TrainParams):
    """AdamW + linear warm-up (5 % of the steps) then cosine decay over every epoch's batches
    (counted from the plans, before any is read). Returns (optimizer, scheduler, total optimizer steps)."""
    opt = torch.optim.AdamW(params, lr=tparams.lr, weight_decay=tparams.weight_decay)
    # the shard order (hence where buffers are cut) depends on (seed, epoch) only; the batch shuffle not the count
    nb = sum(len(buf) for ep in range(tparams.epochs) for buf in stream.epoch_plan(ep, random.Random(0)))
    total = max(1, nb)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, total // 20)) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    return opt, sched, total


def _resume(sdir: Path, fp: str, draft, opt, sched, steps: int, rng: random.Random) -> tuple[dict, int]:
    """The run state: a fresh one, or the saved one (weights, optimizer and schedule loaded into
    `draft`, `opt`, `sched`) when `sdir` holds a state with fingerprint `fp`. Returns (run, resumed step)."""
    run = {"step": 0, "epoch": 0, "batches_done": 0, "losses": [], "tokens": 0, "seconds": 0.0, "skipped": 0,
           "ep_loss": 0.0, "ep_n": 0, "corr": [0] * steps, "cnt": [0] * steps, "epoch_rng": rng.getstate()}
    # rank 0 reads the state and hands it to the others: a node may not see rank 0's disk (SageMaker)
    st = ranks.broadcast(load_state(sdir, fp) if ranks.world()[0] == 0 else None)
    if st is None:
        return run, 0
    draft.load_state_dict(st["draft"])
    opt.load_state_dict(st["opt"])
    sched.load_state_dict(st["sched"])
    return st["run"], st["run"]["step"]


def _train_epoch(draft, opt, sched, params: list, stream: ExampleStream, tparams: TrainParams, rng: random.Random,
                 run: dict, total: int, progress, checkpoint, amp: torch.dtype | None) -> None:
    """One epoch of TTT steps (EAGLE-3 §3.2 training-time test) over `stream`'s plan for epoch
    `run["epoch"]`, from batch `run["batches_done"]` on (a resumed epoch skips what it did, without
    reading it); updates `run` in place and checkpoints every `train.checkpoint_every` optimizer
    steps. `amp`: the autocast dtype of the forward and loss (None: fp32); gradients and AdamW stay
    fp32 on the fp32 weights. Every rank takes every step (a rank without rows adds zeros)."""
    rng.setstate(run["epoch_rng"])  # the epoch's batch order, reproducible on resume
    every, t0, steps = tparams.checkpoint_every, time.perf_counter(), tparams.ttt_steps
    dev = draft.fc.weight.device
    plan = stream.epoch_plan(run["epoch"], rng)
    for bi, tokens, batch in _timed(stream.batches(plan, run["batches_done"], dev), run):
        loss, c, n = torch.zeros(()), [0] * steps, [0] * steps
        if batch is not None:
            with torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
                loss, c, n = ttt_loss(draft, *batch, steps, tparams.loss_decay, denom=tokens, objective=tparams.loss)
        run["batches_done"] = bi + 1
        finite = bool(torch.isfinite(loss))
        learn = loss.requires_grad and finite
        # one all-reduce: [sum of losses, ranks with something to learn, ranks with a bad loss, correct, counts]
        g = ranks.sum_(torch.tensor([float(loss.detach()) if learn else 0.0, float(learn), float(not finite),
                                     *c, *n], dtype=torch.float64))
        if g[1] == 0 or g[2] > 0:  # nothing to learn anywhere / a bad batch on some rank
            run["skipped"] += 1
            continue
        opt.zero_grad(set_to_none=True)
        if learn:
            loss.backward()
        ranks.sum_grads(params)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        run["step"] += 1
        run["tokens"] += tokens
        run["ep_loss"] += float(g[0])
        run["ep_n"] += 1
        run["corr"] = [a + int(b) for a, b in zip(run["corr"], g[3:3 + steps])]
        run["cnt"] = [a + int(b) for a, b in zip(run["cnt"], g[3 + steps:])]
        if progress:
            progress(run["step"], total, float(g[0]))
        if every and run["step"] % every == 0:
            run["seconds"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            checkpoint()
    run["seconds"] += time.perf_counter() - t0


def _timed(batches, run: dict):
    """`batches` as is, the seconds spent waiting for each (reading, preparing, copying to the
    device) added to `run["input_wait"]`: the trainer's input-bound share."""
    it = iter(batches)
    while True:
        t0 = time.perf_counter()
        b = next(it, None)
        run["input_wait"] = run.get("input_wait", 0.0) + time.perf_counter() - t0
        if b is None:
            return
        yield b


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


def _metrics(draft, stream: ExampleStream, val: ExampleStream | None, run: dict, tparams: TrainParams,
             resumed_from: int, dropped: Counter, val_dropped: Counter) -> dict:
    """The metrics `train_draft` returns (its docstring names them), with the holdout evaluation."""
    steps = tparams.ttt_steps
    train_acc = run.get("last_train_acc", [0.0] * steps)
    ev = (evaluate_chunks(draft, val.chunks(), steps, tparams.batch_tokens) if val is not None and len(val)
          else HoldoutEval([], steps))
    secs = run["seconds"]
    metrics = {"train/loss": run["losses"], "train_seconds": secs,
               "train_tokens_per_s": run["tokens"] / secs if secs else 0.0, "train_tokens": run["tokens"],
               "train_input_wait_seconds": run.get("input_wait", 0.0),
               "train_steps": run["step"], "simulated_acceptance_length": ev.simulated_tau(),
               "train_examples": len(stream), "val_examples": len(val) if val is not None else 0,
               "train_buffers": len(stream.epoch_plan(0, random.Random(0))),
               "skipped_nonfinite_steps": run["skipped"], "resumed_from_step": resumed_from,
               "curve": run.get("curve", [])}
    if tparams.rejected_weight:
        metrics["train_rejected_positions"] = stream.weighted_positions
    metrics.update({f"dropped/{k}": v for k, v in dropped.items()})
    metrics.update({f"val_dropped/{k}": v for k, v in val_dropped.items()})
    metrics.update({f"train/acc_{j}": a for j, a in enumerate(train_acc)})
    return metrics | ev.val_metrics()
