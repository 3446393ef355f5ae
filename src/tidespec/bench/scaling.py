"""`tidespec bench scaling`: capture at real widths — bytes per token at rest and the capture path's
CPU cost against the target's own prefill, for SmolLM2 (H = 576, the real model) and the wide
synthetic targets (`bench.synthetic`: H = 2048 and 4096, 4 layers, vocab 32k).

One sequence of HumanEval text (SmolLM2's tokenizer; ids folded into the synthetic vocab) is
prefilled `rounds` times per width, widths interleaved per round. Per width: the record's bytes
per token stored raw (bf16 safetensors) and zstd (byte-shuffled, as `capture.compression: zstd`),
and the text a Data Capture line holds per token; the prefill's ms per token; the capture path's
thread CPU time per token (copy to CPU bf16 + encode), its median and range over rounds, and its
ratio to the prefill. Synthetic hidden states come from random weights: their zstd ratio is not
a real model's (SmolLM2's row is). Output: `<out>/scaling.json` + `<out>/scaling.md`.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from ..assets.prompts import load
from ..capture.store import encode_shard
from ..config import Params
from ..models.load import get_target
from ..models.target import Segment
from .synthetic import named

WIDTHS = ("smollm2", "h2048", "llama8b-width")


def _text(tok, n_tokens: int) -> tuple[list[int], str]:
    text = ""
    for p in load("humaneval"):
        text += p.text
        ids = tok(text)["input_ids"]
        if len(ids) >= n_tokens:
            return ids[:n_tokens], tok.decode(ids[:n_tokens])
    raise ValueError(f"HumanEval holds fewer than {n_tokens} tokens")


def _round(target, ids: list[int]) -> dict:
    """One prefill of `ids` and the capture of its record: ms/token, CPU µs/token, bytes/token."""
    x = torch.tensor([i % target.cfg.vocab_size for i in ids])
    t0 = time.perf_counter()
    out = target.forward_batch([Segment(x, target.new_cache(len(ids)), last_only=True)])[0]
    prefill = time.perf_counter() - t0
    c0 = time.thread_time()
    rec = {"input_ids": x.to(torch.int32), "loss_mask": torch.ones(len(ids), dtype=torch.uint8),
           "aux_hidden_states": out.aux.to("cpu", torch.bfloat16),
           "hidden_states": out.hidden.to("cpu", torch.bfloat16)}
    raw = encode_shard([rec], "none")
    c1 = time.thread_time()
    z = encode_shard([rec], "zstd")
    c2 = time.thread_time()
    n = len(ids)
    return {"prefill_ms_per_token": 1000 * prefill / n, "raw_cpu_us_per_token": 1e6 * (c1 - c0) / n,
            "zstd_cpu_us_per_token": 1e6 * (c2 - c0) / n, "raw_bytes_per_token": len(raw) / n,
            "zstd_bytes_per_token": len(z) / n}


def run(params: Params, out: Path, n_tokens: int = 512, rounds: int = 3, progress=print) -> dict:
    """Measure every width of `WIDTHS` (`rounds` interleaved rounds, one `n_tokens` sequence);
    write `<out>/scaling.json` and `.md`; return the report. Needs ~6 GiB free memory (the 4096-wide
    target is 3.7 GiB)."""
    real, tok = get_target(params)
    ids, text = _text(tok, n_tokens)
    line = json.dumps({"prompt": text, "choices": [{"text": ""}]})  # a Data Capture body holds the text
    targets = {w: real if w == "smollm2" else named(w) for w in WIDTHS}
    per = {w: [] for w in WIDTHS}
    for r in range(rounds):
        for w in WIDTHS:
            per[w].append(_round(targets[w], ids))
        progress(f"scaling: round {r + 1}/{rounds} done")
    rep = {"n_tokens": n_tokens, "rounds": rounds, "text_bytes_per_token": len(text.encode()) / n_tokens,
           "data_capture_bytes_per_token": len(line.encode()) / n_tokens, "widths": {}}
    for w in WIDTHS:
        t = targets[w]
        row = {"hidden": t.cfg.hidden_size, "layers": t.cfg.num_layers, "vocab": t.cfg.vocab_size}
        for k in per[w][0]:
            vals = [p[k] for p in per[w]]
            row[k] = statistics.median(vals)
            row[k + "_range"] = [min(vals), max(vals)]
        row["zstd_cpu_share_of_prefill"] = row["zstd_cpu_us_per_token"] / (1000 * row["prefill_ms_per_token"])
        rep["widths"][w] = row
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.json").write_text(json.dumps(rep, indent=2))
    (out / "scaling.md").write_text(markdown(rep))
    return rep


def markdown(rep: dict) -> str:
    """The report as a markdown table."""
    lines = [f"Capture at real widths: {rep['n_tokens']}-token prefill × {rep['rounds']} rounds (median, range).",
             "", "| target | H | raw B/token | zstd B/token | prefill ms/token | capture CPU µs/token (zstd) | "
             "share of prefill |", "|---|---|---|---|---|---|---|"]
    for w, r in rep["widths"].items():
        lo, hi = r["zstd_cpu_us_per_token_range"]
        lines.append(f"| {w} | {r['hidden']} | {r['raw_bytes_per_token']:.0f} | {r['zstd_bytes_per_token']:.0f} | "
                     f"{r['prefill_ms_per_token']:.2f} | {r['zstd_cpu_us_per_token']:.1f} ({lo:.1f}–{hi:.1f}) | "
                     f"{100 * r['zstd_cpu_share_of_prefill']:.1f} % |")
    lines += ["", f"Text at rest: {rep['text_bytes_per_token']:.1f} B/token of UTF-8, "
              f"{rep['data_capture_bytes_per_token']:.1f} B/token as a Data Capture body.", ""]
    return "\n".join(lines)
