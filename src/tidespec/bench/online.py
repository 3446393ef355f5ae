"""`tidespec bench online`: online rehydration against hidden states read from disk.

One set of `tokens` tokens (random ids, records of `seq_len`, the last 3/4 generated) is written
twice with the capture writer: with its hidden states (the target's prefill, as `ingest.mode:
hidden` writes them) and tokens only (`ingest.mode: online`). Then, in `passes` interleaved
passes, in this process:

- **records/s**: every record read back as the trainer reads it, from disk (`IndexRecords`,
  the page cache warm: a second read of a fresh snapshot) or rebuilt by the target
  (`OnlineRecords`), tokens per second;
- **train step**: `train_draft` over each set, `epochs` epochs streamed through a buffer of
  `buffer_mb` (so every epoch reads its records again), wall seconds; online with the producer
  thread (`train.prefetch_mb` 64) and without it (0: the prefill in line), to show what the
  pipeline overlaps.

Reported: medians, ranges and paired ratios per pass (online / hidden), bytes per token at
rest. Targets: `smollm2` (the real one of params.yaml) or a synthetic width
(`bench.synthetic.WIDTHS`: random weights, so the draft learns nothing; only time and bytes
are measured). `device` places the target and the draft (`target.device` and `train.device`;
cuda trains under bf16 autocast): on a GPU the rows add the trainer's tokens/s, its model FLOP
utilisation against `peak_tflops` (6 · trainable parameters · `train.ttt_steps` FLOP per token,
EAGLE-3 §3.2's k forward-backward passes; the teacher's lm_head not counted) and the peak GPU
memory. Output: `<out>/online_rehydration-<target>[-<device>].{json,md}`.
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from ..capture.rehydrate import rehydrate, token_record
from ..capture.snapshots import list_snapshots, seal
from ..capture.store import read_manifest
from ..capture.writer import CaptureWriter
from ..config import CaptureParams, DraftParams, TrainParams, load_params
from ..models.device import resolve_device
from ..train.online import OnlineRecords
from ..train.source import IndexRecords
from ..train.trainer import train_draft


def _target(name: str, params_path: Path, device: str):
    if name == "smollm2":
        from ..models.load import get_target
        p = load_params(params_path)
        return get_target(p.model_copy(update={"target": p.target.model_copy(update={"device": device})}))[0]
    from .synthetic import named
    return named(name, device=resolve_device(device, "--device"))


def _write(root: Path, target, records: list[dict]) -> IndexRecords:
    """`records` captured and sealed into one snapshot under `root`; its entries as a source."""
    shutil.rmtree(root, ignore_errors=True)
    tid = target.target_id
    w = CaptureWriter(root / "capture", tid, CaptureParams(shard_max_records=16, queue_size=len(records) + 1))
    for i, r in enumerate(records):
        w.submit(r, request_id=f"r{i}", workload="code", acceptance_length=1.0, prompt_id=f"r{i}")
    w.close()
    seal(root / "capture", root / "snapshots", tid)
    snap = list_snapshots(root / "snapshots", tid)[0]
    entries = [{"snapshot": snap.name, "shard": r.shard, "offset": r.offset, "request_id": r.request_id,
                "num_tokens": r.num_tokens, **({"tokens_only": True} if r.tokens_only else {})}
               for r in read_manifest(snap)]
    return IndexRecords(entries, snap.parent)


def _read_all(src) -> float:
    """Tokens per second of reading every record of `src` (all fields)."""
    t0 = time.perf_counter()
    n = sum(int(src.read(i)["hidden_states"].shape[0]) for i in range(len(src)))
    return n / (time.perf_counter() - t0)


def _train(src, target, tparams: TrainParams, out: Path, draft_vocab: int) -> dict:
    """One `train_draft` run: wall seconds, the trainer's tokens/s and (on CUDA) peak GPU MiB."""
    shutil.rmtree(out, ignore_errors=True)
    cuda = torch.cuda.is_available() and resolve_device(tparams.device, "--device").type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m = train_draft(src, [], target, DraftParams(draft_vocab_size=min(draft_vocab, target.cfg.vocab_size)), tparams,
                    out)
    return {"train_s": time.perf_counter() - t0, "train_tokens_per_s": m["train_tokens_per_s"],
            "input_wait_share": m["train_input_wait_seconds"] / max(m["train_seconds"], 1e-9),
            "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}


def trainable_params(out: Path, target) -> int:
    """Trainable parameters of the draft saved in `out` (its frozen embedding, the target's, not counted)."""
    from ..models.eagle3 import load_checkpoint
    return sum(p.numel() for p in load_checkpoint(out, target.embed, target.target_id).parameters())


def run(target_name: str, params_path: Path, out: Path, work: Path, tokens: int, seq_len: int, passes: int,
        epochs: int, buffer_mb: float, progress=print, device: str = "cpu", peak_tflops: float = 790.0,
        draft_vocab: int = 4096, batch_tokens: int = 1024) -> dict:
    """The figures of the module docstring, written to `out`; returns them. Raises ValueError for a
    `device` torch cannot see."""
    torch.manual_seed(0)
    target = _target(target_name, params_path, device)
    V, n = target.cfg.vocab_size, max(2, tokens // seq_len)
    g = torch.Generator().manual_seed(0)
    exchanges = [torch.randint(3, V, (seq_len + 1,), generator=g).tolist() for _ in range(n)]
    cut = seq_len // 4
    t0 = time.perf_counter()
    full = [rehydrate(target, e[:cut], e[cut:]) for e in exchanges]
    ingest_tps = n * seq_len / (time.perf_counter() - t0)
    hidden = _write(work / "hidden", target, full)
    del full
    onl_index = _write(work / "online", target, [token_record(target, e[:cut], e[cut:]) for e in exchanges])
    online = OnlineRecords(onl_index, _embedded(target), "embedded")
    at_rest = {k: sum(f.stat().st_size for f in (work / k / "snapshots").rglob("*.safetensors")) / (n * seq_len)
               for k in ("hidden", "online")}
    tp = dict(epochs=epochs, batch_tokens=batch_tokens, max_seq_len=seq_len, buffer_mb=buffer_mb, checkpoint_every=0,
              ttt_steps=2, warm_start=False, device=device)
    arms = {"hidden (disk)": (hidden, 64.0), "online, producer thread": (online, 64.0),
            "online, in line": (online, 0.0)}
    rows: dict[str, list[dict]] = {a: [] for a in arms}
    _read_all(hidden)  # the page cache warm for every pass alike
    for p in range(passes):
        for name, (src, pf) in arms.items():
            r = {"read_tokens_per_s": _read_all(src) if pf else None,
                 **_train(src, target, TrainParams(**tp, prefetch_mb=pf), work / "cand", draft_vocab)}
            rows[name].append(r)
            progress(f"pass {p + 1}/{passes} {name}: train {r['train_s']:.1f} s"
                     + (f", read {r['read_tokens_per_s']:.0f} tokens/s" if r["read_tokens_per_s"] else ""))
    n_params = trainable_params(work / "cand", target)
    res = {"target": target_name, "device": str(target.device), "hidden_size": target.cfg.hidden_size,
           "gpu": torch.cuda.get_device_name() if target.device.type == "cuda" else None,
           "draft_trainable_params": n_params, "flop_per_trained_token": 6 * n_params * tp["ttt_steps"],
           "peak_tflops": peak_tflops, "batch_tokens": batch_tokens, "tokens": n * seq_len,
           "seq_len": seq_len, "passes": passes, "epochs": epochs, "buffer_mb": buffer_mb,
           "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "ingest_prefill_tokens_per_s": ingest_tps,
           "bytes_per_token_at_rest": at_rest, "arms": _summary(rows)}
    stem = f"online_rehydration-{target_name}" + ("" if device == "cpu" else f"-{target.device.type}")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    (out / f"{stem}.md").write_text(_markdown(res))
    res["stem"] = stem
    return res


def _embedded(target):
    from ..capture.ingest import EmbeddedRehydrator
    return EmbeddedRehydrator(target)


def _summary(rows: dict[str, list[dict]]) -> dict:
    ref = rows["hidden (disk)"]
    out = {}
    for name, rs in rows.items():
        secs = [r["train_s"] for r in rs]
        ratio = [r["train_s"] / h["train_s"] for r, h in zip(rs, ref)]
        reads = [r["read_tokens_per_s"] for r in rs if r["read_tokens_per_s"]]
        tps = [r["train_tokens_per_s"] for r in rs]
        wait = [r["input_wait_share"] for r in rs]
        peak = [r["peak_gpu_mib"] for r in rs if r["peak_gpu_mib"] is not None]
        out[name] = {"train_s": statistics.median(secs), "train_s_range": [min(secs), max(secs)],
                     "train_s_vs_hidden": statistics.median(ratio), "ratio_range": [min(ratio), max(ratio)],
                     "read_tokens_per_s": statistics.median(reads) if reads else None,
                     "read_range": [min(reads), max(reads)] if reads else None,
                     "train_tokens_per_s": statistics.median(tps), "train_tokens_per_s_range": [min(tps), max(tps)],
                     "input_wait_share": statistics.median(wait),
                     "peak_gpu_mib": max(peak) if peak else None}
    return out


def _markdown(res: dict) -> str:
    a, b = res["arms"], res["bytes_per_token_at_rest"]
    lines = [f"# Online rehydration vs hidden states on disk ({res['target']}, H = {res['hidden_size']}, "
             f"{res['tokens']} tokens of {res['seq_len']}, {res['epochs']} epochs streamed through "
             f"{res['buffer_mb']} MiB, {res['passes']} passes, {res['threads']} thread(s), {res['cpus']} CPUs)", "",
             f"At rest: {b['hidden']:.0f} bytes/token with hidden states, {b['online']:.1f} tokens only. "
             f"The ingest's prefill ran at {res['ingest_prefill_tokens_per_s']:.0f} tokens/s "
             f"on {res['device']}{' (' + res['gpu'] + ')' if res['gpu'] else ''}. Draft: "
             f"{res['draft_trainable_params'] / 1e6:.0f}M trainable parameters, "
             f"{res['flop_per_trained_token'] / 1e9:.1f} GFLOP per trained token.", "",
             "| arm | records read, tokens/s (median, range) | train step s (median, range) | × hidden "
             f"(paired median, range) | trainer tokens/s | waiting for input | MFU (of {res['peak_tflops']:.0f} "
             "TFLOP/s) | peak GPU MiB |", "|---|---|---|---|---|---|---|---|"]
    for name, r in a.items():
        read = (f"{r['read_tokens_per_s']:.0f} ({r['read_range'][0]:.0f}–{r['read_range'][1]:.0f})"
                if r["read_tokens_per_s"] else "—")
        lines.append(f"| {name} | {read} | {r['train_s']:.1f} ({r['train_s_range'][0]:.1f}–"
                     f"{r['train_s_range'][1]:.1f}) | {r['train_s_vs_hidden']:.2f} ({r['ratio_range'][0]:.2f}–"
                     f"{r['ratio_range'][1]:.2f}) | {r['train_tokens_per_s']:.0f} | {r['input_wait_share']:.0%} | "
                     f"{r['train_tokens_per_s'] * res['flop_per_trained_token'] / (res['peak_tflops'] * 1e12):.1%} | "
                     f"{'—' if r['peak_gpu_mib'] is None else format(r['peak_gpu_mib'], '.0f')} |")
    return "\n".join(lines) + "\n"
