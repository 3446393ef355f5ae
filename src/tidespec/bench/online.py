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
are measured). Output: `<out>/online_rehydration-<target>.{json,md}`.
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
from ..train.online import OnlineRecords
from ..train.source import IndexRecords
from ..train.trainer import train_draft


def _target(name: str, params_path: Path):
    if name == "smollm2":
        from ..models.load import get_target
        return get_target(load_params(params_path))[0]
    from .synthetic import named
    return named(name)


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


def _train_s(src, target, tparams: TrainParams, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    train_draft(src, [], target, DraftParams(draft_vocab_size=min(4096, target.cfg.vocab_size)), tparams, out)
    return time.perf_counter() - t0


def run(target_name: str, params_path: Path, out: Path, work: Path, tokens: int, seq_len: int, passes: int,
        epochs: int, buffer_mb: float, progress=print) -> dict:
    """The figures of the module docstring, written to `out`; returns them."""
    torch.manual_seed(0)
    target = _target(target_name, params_path)
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
    tp = dict(epochs=epochs, batch_tokens=1024, max_seq_len=seq_len, buffer_mb=buffer_mb, checkpoint_every=0,
              ttt_steps=2, warm_start=False)
    arms = {"hidden (disk)": (hidden, 64.0), "online, producer thread": (online, 64.0),
            "online, in line": (online, 0.0)}
    rows: dict[str, list[dict]] = {a: [] for a in arms}
    _read_all(hidden)  # the page cache warm for every pass alike
    for p in range(passes):
        for name, (src, pf) in arms.items():
            r = {"read_tokens_per_s": _read_all(src) if pf else None,
                 "train_s": _train_s(src, target, TrainParams(**tp, prefetch_mb=pf), work / "cand")}
            rows[name].append(r)
            progress(f"pass {p + 1}/{passes} {name}: train {r['train_s']:.1f} s"
                     + (f", read {r['read_tokens_per_s']:.0f} tokens/s" if r["read_tokens_per_s"] else ""))
    res = {"target": target_name, "hidden_size": target.cfg.hidden_size, "tokens": n * seq_len,
           "seq_len": seq_len, "passes": passes, "epochs": epochs, "buffer_mb": buffer_mb,
           "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "ingest_prefill_tokens_per_s": ingest_tps,
           "bytes_per_token_at_rest": at_rest, "arms": _summary(rows)}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"online_rehydration-{target_name}.json").write_text(json.dumps(res, indent=2))
    (out / f"online_rehydration-{target_name}.md").write_text(_markdown(res))
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
        out[name] = {"train_s": statistics.median(secs), "train_s_range": [min(secs), max(secs)],
                     "train_s_vs_hidden": statistics.median(ratio), "ratio_range": [min(ratio), max(ratio)],
                     "read_tokens_per_s": statistics.median(reads) if reads else None,
                     "read_range": [min(reads), max(reads)] if reads else None}
    return out


def _markdown(res: dict) -> str:
    a, b = res["arms"], res["bytes_per_token_at_rest"]
    lines = [f"# Online rehydration vs hidden states on disk ({res['target']}, H = {res['hidden_size']}, "
             f"{res['tokens']} tokens of {res['seq_len']}, {res['epochs']} epochs streamed through "
             f"{res['buffer_mb']} MiB, {res['passes']} passes, {res['threads']} thread(s), {res['cpus']} CPUs)", "",
             f"At rest: {b['hidden']:.0f} bytes/token with hidden states, {b['online']:.1f} tokens only. "
             f"The ingest's prefill ran at {res['ingest_prefill_tokens_per_s']:.0f} tokens/s.", "",
             "| arm | records read, tokens/s (median, range) | train step s (median, range) | × hidden "
             "(paired median, range) |", "|---|---|---|---|"]
    for name, r in a.items():
        read = (f"{r['read_tokens_per_s']:.0f} ({r['read_range'][0]:.0f}–{r['read_range'][1]:.0f})"
                if r["read_tokens_per_s"] else "—")
        lines.append(f"| {name} | {read} | {r['train_s']:.1f} ({r['train_s_range'][0]:.1f}–"
                     f"{r['train_s_range'][1]:.1f}) | {r['train_s_vs_hidden']:.2f} ({r['ratio_range'][0]:.2f}–"
                     f"{r['ratio_range'][1]:.2f}) |")
    return "\n".join(lines) + "\n"
