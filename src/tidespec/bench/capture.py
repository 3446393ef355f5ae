"""`tidespec bench capture`: what capture costs on the serving path, and on disk.

The real target serves HumanEval prompts greedily (no speculation: capture cost is per processed
token) in four configurations, in blocks rotated every round (ABCD ABCD ...) so machine-load
drift hits all alike: capture off; on (raw bf16); on (zstd); on with a hung disk (the writer
blocks in every shard write, queue of 2: it fills and records are dropped, never waited for).
Each block's writer writes one shard per request concurrently with the next request's decoding
(the worst case of steady serving: an fsync per record); it is closed between blocks.
Reported: ITL p50/p99 (ms), tokens/s and their ratio to capture-off, bytes per captured token,
drops. Output: `<out>/capture.json` + `<out>/capture.md`.
"""
from __future__ import annotations

import json
import platform
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from ..capture import writer as writer_mod
from ..capture.writer import CaptureWriter
from ..config import Params
from ..engine.speculative import Engine
from ..engine.stats import itl_percentiles

CONFIGS = ("off", "raw", "zstd", "hung_disk")


class _HungDisk:
    """Makes `write_shard` block until released (a disk that stopped answering)."""

    def __init__(self):
        self.gate = threading.Event()
        self.real = writer_mod.write_shard

    def __enter__(self):
        writer_mod.write_shard = lambda *a: (self.gate.wait(), self.real(*a))[1]
        return self

    def __exit__(self, *exc):
        self.gate.set()
        writer_mod.write_shard = self.real


def _block(eng: Engine, prompts: list[list[int]], max_new: int, w: CaptureWriter | None) -> dict:
    itl, toks, secs = [], 0, 0.0
    for ids in prompts:
        g = eng.generate(ids, max_new, speculative=False, capture=w is not None)
        if w is not None:
            w.submit_generation(g, "code")
        itl += g.timing.itl_ms()
        toks += len(g.tokens)
        secs += g.timing.prefill_s + g.timing.decode_s
    return {"itl": itl, "tokens": toks, "seconds": secs}


def run(params: Params, out: Path, n_prompts: int = 8, max_new_tokens: int = 64, rounds: int = 3,
        progress: Callable[[str], None] = print) -> dict:
    """Measure; write `<out>/capture.json` and `.md`. Returns the report."""
    from ..bootstrap import prompt_ids
    from ..cycle import get_target
    from ..prompts import load
    t0 = time.perf_counter()
    target, tok = get_target(params)
    prompts = [prompt_ids(tok, p.text) for p in load("humaneval")[:n_prompts]]
    eng = Engine(target, None, 1, params.engine.max_seq_len)
    _block(eng, prompts[:1], 8, None)  # warm-up
    acc = {c: {"itl": [], "tokens": 0, "seconds": 0.0, "bytes": 0, "captured_tokens": 0, "dropped": {}}
           for c in CONFIGS}
    tmp = Path(tempfile.mkdtemp(prefix="tidespec-bench-capture-"))
    for r in range(rounds):
        order = CONFIGS[r % 4:] + CONFIGS[:r % 4]
        for c in order:
            progress(f"round {r + 1}/{rounds}: {c}")
            w = None
            if c != "off":
                # 1 record per shard: every shard write (encode, fsync) overlaps the next request's
                # decode, as in steady serving; the hung disk gets a 2-slot queue so it overflows
                w = CaptureWriter(tmp / f"{c}-{r}", target.target_id, 2 if c == "hung_disk" else 64, 1,
                                  compression="none" if c == "raw" else "zstd", idle_flush_s=60.0)
            if c == "hung_disk":
                with _HungDisk():
                    b = _block(eng, prompts, max_new_tokens, w)
            else:
                b = _block(eng, prompts, max_new_tokens, w)
            a = acc[c]
            a["itl"] += b["itl"]
            a["tokens"] += b["tokens"]
            a["seconds"] += b["seconds"]
            if w is not None:
                w.close()
                st = w.stats()
                a["bytes"] += st.bytes_total
                a["captured_tokens"] += st.tokens_total
                for k, v in st.dropped.items():
                    a["dropped"][k] = a["dropped"].get(k, 0) + v
    rows = {}
    for c, a in acc.items():
        rows[c] = {**itl_percentiles(a["itl"]), "tokens_per_s": a["tokens"] / a["seconds"],
                   "bytes_per_token": a["bytes"] / a["captured_tokens"] if a["captured_tokens"] else None,
                   "dropped": a["dropped"]}
    off = rows["off"]
    for c in CONFIGS:
        rows[c]["itl_p50_ratio"] = rows[c]["itl_ms_p50"] / off["itl_ms_p50"]
        rows[c]["tokens_per_s_ratio"] = rows[c]["tokens_per_s"] / off["tokens_per_s"]
    H = target.cfg.hidden_size
    rep = {"setup": {"target": params.target.source, "dtype": params.target.dtype, "hidden_size": H,
                     "prompts": n_prompts, "max_new_tokens": max_new_tokens, "rounds": rounds,
                     "queue_size": "64 (hung_disk: 2)", "shard_max_records": 1,
                     "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
                     "raw_bytes_per_token": 4 * H * 2 + 4 + 1, "wall_s": time.perf_counter() - t0},
           "rows": rows}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "capture.json").write_text(json.dumps(rep, indent=2))
    (out / "capture.md").write_text(markdown(rep))
    return rep


def markdown(rep: dict) -> str:
    s = rep["setup"]
    lines = [f"# Capture cost ({s['target']}, {s['dtype']}, H={s['hidden_size']}, {s['threads']} threads, "
             f"{s['prompts']} HumanEval prompts × {s['max_new_tokens']} tokens × {s['rounds']} rounds, no speculation)",
             "", "| capture | ITL p50 ms | ITL p99 ms | p50 vs off | tokens/s | vs off | bytes/token | dropped |",
             "|---|---|---|---|---|---|---|---|"]
    for c, r in rep["rows"].items():
        bpt = f"{r['bytes_per_token']:.0f}" if r["bytes_per_token"] else "-"
        lines.append(f"| {c} | {r['itl_ms_p50']:.1f} | {r['itl_ms_p99']:.1f} | {r['itl_p50_ratio']:.3f}× | "
                     f"{r['tokens_per_s']:.1f} | {r['tokens_per_s_ratio']:.3f}× | {bpt} | "
                     f"{sum(r['dropped'].values()) or 0} |")
    lines += ["", f"Raw record size: (3H + H) bf16 + int32 id + uint8 mask = {s['raw_bytes_per_token']} bytes/token. "
              "hung_disk: every shard write blocks until the block ends; the engine never waits, the overflow "
              "is dropped and counted. Ratios are measured side by side in one run (blocks rotated per round)."]
    return "\n".join(lines) + "\n"
