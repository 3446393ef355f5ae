"""`tidespec bench capture`: what capture costs on the serving path, and on disk.

The real target serves HumanEval prompts greedily (no speculation: capture cost is per processed
token) in four configurations, interleaved prompt by prompt with a rotating order (machine-load
drift hits all alike; per-block runs on this shared VM drifted by ±15 %): capture off; on (raw
bf16); on (zstd); on with a hung disk (its writer blocks in the first shard write, queue of 2:
the queue fills and records are dropped, never waited for). Each writer writes one shard (with
fsync) per request, on its own thread, overlapping the next request's decoding: the worst case of
steady serving. Reported: ITL p50/p99 (ms), tokens/s and their ratio to capture-off, bytes per
captured token, the writer thread's CPU time per token (thread CPU clock: immune to the machine's
noise), drops. Output: `<out>/capture.json` + `<out>/capture.md`.
"""
from __future__ import annotations

import json
import platform
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..assets.prompts import load
from ..capture.text import TextCapture
from ..capture.writer import CaptureWriter
from ..config import CaptureParams, Params
from ..engine.build import make_engine
from ..engine.stats import itl_percentiles
from ..models.chat import prompt_ids
from ..models.load import get_target

CONFIGS = ("off", "raw", "zstd", "hung_disk", "text")


def _hang(w: CaptureWriter, gate: threading.Event) -> None:
    """Make `w`'s disk writes block until `gate` is set (a disk that stopped answering)."""
    real = w._write_pending
    w._write_pending = lambda: (gate.wait(), real())[1]


def run(params: Params, out: Path, n_prompts: int = 8, max_new_tokens: int = 64, rounds: int = 3,
        progress: Callable[[str], None] = print) -> dict:
    """Serve `n_prompts` HumanEval prompts × `max_new_tokens` × `rounds` per configuration; write
    `<out>/capture.json` and `.md`. Returns the report: per configuration ITL p50/p99 (ms),
    tokens/s, their ratios to capture off, bytes per captured token, writer CPU (µs/token and share
    of serving time), drops by reason. Loads the real target (params.target). Each configuration
    has its own engine over the one target, its writer as the engine's capture sink."""
    t0 = time.perf_counter()
    target, tok = get_target(params)
    prompts = [prompt_ids(tok, p.text) for p in load("humaneval")[:n_prompts]]
    make_engine(params.engine.fixed(), target).generate(prompts[0], 8, speculative=False)  # warm-up
    tmp = Path(tempfile.mkdtemp(prefix="tidespec-bench-capture-"))
    gate = threading.Event()
    writers = {
        c: CaptureWriter(
            tmp / c,
            target.target_id,
            CaptureParams(
                queue_size=2 if c == "hung_disk" else 64,
                shard_max_records=1,
                compression="none" if c == "raw" else "zstd",
            ),
            idle_flush_s=3600.0,
        )
        for c in CONFIGS
        if c != "off"
    }
    _hang(writers["hung_disk"], gate)
    text = TextCapture(tmp / "text")  # capture.mode: text — request/response bodies, logged after the response
    text_stats = {"bytes": 0, "tokens": 0, "cpu_s": 0.0, "wall_s": 0.0, "records": 0}
    engines = {c: make_engine(params.engine.fixed(), target, capture=writers.get(c)) for c in CONFIGS}
    acc = {c: {"itl": [], "tokens": 0, "seconds": 0.0} for c in CONFIGS}
    n = 0
    for r in range(rounds):
        progress(f"round {r + 1}/{rounds}: {len(prompts)} prompts × {len(CONFIGS)} configurations")
        for ids in prompts:
            order = CONFIGS[n % len(CONFIGS):] + CONFIGS[:n % len(CONFIGS)]
            n += 1
            for c in order:
                g = engines[c].generate(ids, max_new_tokens, speculative=False, workload="code")
                a = acc[c]
                a["itl"] += g.timing.itl_ms()
                a["tokens"] += len(g.tokens)
                a["seconds"] += g.timing.prefill_s + g.timing.decode_s
                if c == "text":  # on the request's path after its last token (as the server logs it)
                    c0, w0 = time.thread_time(), time.perf_counter()
                    req = {"model": "tidespec", "prompt": tok.decode(ids), "max_tokens": max_new_tokens}
                    resp = {"object": "text_completion", "choices": [
                        {"index": 0, "text": tok.decode(g.tokens, skip_special_tokens=True),
                         "finish_reason": g.finish_reason}]}
                    text_stats["bytes"] += text.log(g.request_id, req, resp)
                    text_stats["cpu_s"] += time.thread_time() - c0
                    dt = time.perf_counter() - w0
                    text_stats["wall_s"] += dt
                    a["seconds"] += dt
                    text_stats["tokens"] += len(ids) + len(g.tokens) - 1  # the tokens a hidden-state record holds
                    text_stats["records"] += 1
    gate.set()
    rows = {}
    for c, a in acc.items():
        st = None
        if c in writers:
            writers[c].close()
            st = writers[c].stats()
        ct = st.tokens_total if st else 0
        if c == "text":
            text.close()
            ts = text_stats
            rows[c] = {**itl_percentiles(a["itl"]), "tokens_per_s": a["tokens"] / a["seconds"],
                       "bytes_per_token": ts["bytes"] / ts["tokens"], "dropped": {},
                       "writer_cpu_us_per_token": 1e6 * ts["cpu_s"] / ts["tokens"],
                       "writer_cpu_share": ts["cpu_s"] / a["seconds"],
                       "writer_wall_ms_per_shard": 1e3 * ts["wall_s"] / ts["records"]}
            continue
        rows[c] = {**itl_percentiles(a["itl"]), "tokens_per_s": a["tokens"] / a["seconds"],
                   "bytes_per_token": st.bytes_per_token if ct else None, "dropped": st.dropped if st else {},
                   # the writer thread's CPU per captured token, against the serving time
                   "writer_cpu_us_per_token": 1e6 * st.write_cpu_s / ct if ct else None,
                   "writer_cpu_share": st.write_cpu_s / a["seconds"] if ct else None,
                   "writer_wall_ms_per_shard": 1e3 * st.write_wall_s / st.written_total if ct else None}
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
    """The report as a markdown table (`capture.md`)."""
    s = rep["setup"]
    lines = [f"# Capture cost ({s['target']}, {s['dtype']}, H={s['hidden_size']}, {s['threads']} threads, "
             f"{s['prompts']} HumanEval prompts × {s['max_new_tokens']} tokens × {s['rounds']} rounds, no speculation)",
             "", "| capture | ITL p50 ms | ITL p99 ms | p50 vs off | tokens/s | vs off | bytes/token | "
             "writer CPU µs/token | writer CPU / serving time | dropped |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c, r in rep["rows"].items():
        bpt = f"{r['bytes_per_token']:.0f}" if r["bytes_per_token"] else "-"
        cpu = f"{r['writer_cpu_us_per_token']:.0f}" if r["writer_cpu_us_per_token"] else "-"
        share = f"{100 * r['writer_cpu_share']:.2f} %" if r["writer_cpu_share"] else "-"
        lines.append(f"| {c} | {r['itl_ms_p50']:.1f} | {r['itl_ms_p99']:.1f} | {r['itl_p50_ratio']:.3f}× | "
                     f"{r['tokens_per_s']:.1f} | {r['tokens_per_s_ratio']:.3f}× | {bpt} | {cpu} | {share} | "
                     f"{sum(r['dropped'].values()) or 0} |")
    lines += ["", f"Raw record size: (3H + H) bf16 + int32 id + uint8 mask = {s['raw_bytes_per_token']} bytes/token. "
              "text (capture.mode: text): the request and response bodies in the Data Capture format, one "
              "fsynced line per request, logged on the request's path after its last token (counted in tokens/s; "
              "ITL untouched); bytes/token per token a hidden-state record would hold. "
              "hung_disk: the writer blocks in its first shard write until the end; the engine never waits, "
              "the overflow is dropped and counted. Ratios are measured side by side in one run (interleaved "
              "per prompt, rotating order); "
              "on a shared machine they carry its noise, the writer's CPU time (thread CPU clock) does not: "
              "it bounds what capture can take from decoding."]
    return "\n".join(lines) + "\n"
