"""`tidespec bench vllm-swap`: a new champion into a serving vLLM, in place against blue/green.

For each of `--passes` passes (the two modes interleaved), a `VLLMDeployment` serves the SmolLM2
target with draft A, then installs draft B (same config, e.g. two champions `make demo` deployed):
- **in place**: B loaded into the running server (`tidespec_load_draft` + prefix cache reset);
- **blue/green**: a second server started with B, canary, switch, stop the first.

Measured: the swap's wall seconds (`install`), and the memory of every vLLM process (RSS summed
over the servers' process trees, sampled every 20 ms by a thread) before and at its peak during the
swap. One server's RSS holds its CPU KV cache (`--kv-cache-gib`) and weights. No load is sent:
this measures the swap itself; `tests/test_vllm_real.py` checks it under load. Output: JSON.

    tidespec bench vllm-swap DRAFT_A DRAFT_B --passes 3 --out bench/results/vllm-swap.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
from pathlib import Path

import psutil

from tidespec.backends import vllm
from tidespec.backends.vllm.deployment import VLLMDeployment
from tidespec.config import Params
from tidespec.workspace import make_bundle, write_version


def parser() -> argparse.ArgumentParser:
    """The command line (`tidespec bench vllm-swap` ARGS)."""
    ap = argparse.ArgumentParser(prog="tidespec bench vllm-swap", description=__doc__.splitlines()[0])
    ap.add_argument("draft_a", type=Path, help="the draft served first (a bundle or engine dir)")
    ap.add_argument("draft_b", type=Path, help="the draft installed (same config as draft_a)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--kv-cache-gib", type=int, default=2)
    ap.add_argument("--python", default=f"{vllm.VENV}/bin/python")
    ap.add_argument("--out", type=Path)
    return ap


class _Peak:
    """Peak summed RSS (MiB) of every process whose command line names vLLM's server module."""

    def __init__(self):
        self.peak, self._stop = 0.0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def now() -> float:
        total = 0
        for p in psutil.process_iter(["cmdline", "memory_info"]):
            if any("vllm" in a for a in (p.info["cmdline"] or [])) and p.info["memory_info"]:
                total += p.info["memory_info"].rss
        return total / 2**20

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.now())

    def __enter__(self):
        self.peak = self.now()
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def one(mode: str, a: Path, b: Path, args, work: Path) -> dict:
    """One deployment serving `a`, then `b` installed by `mode`: seconds and memory."""
    launch = vllm.VLLMLaunch.from_params(Params(), python=args.python, num_speculative_tokens=args.k,
                                         served_model_name="smollm2", max_model_len=1024, max_num_seqs=8,
                                         kv_cache_gib=args.kv_cache_gib)  # the shipped target (SmolLM2), fp32
    dep = VLLMDeployment(launch, work / mode, in_place=mode == "in_place").start(a)
    try:
        before = _Peak.now()
        with _Peak() as peak:
            res = dep.install(b)
        assert res["mode"] == mode, res
        return {"seconds": res["seconds"], "rss_before_mib": before, "rss_peak_mib": peak.peak,
                "rss_extra_mib": peak.peak - before}
    finally:
        dep.close()


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        bundles = []
        for i, src in enumerate((a.draft_a, a.draft_b)):
            bundles.append(make_bundle(src, work / f"bundle-{i}"))
            write_version(bundles[-1], str(i + 1), "bench")
        rows: dict[str, list[dict]] = {"in_place": [], "blue_green": []}
        for p in range(a.passes):
            for mode in rows:
                rows[mode].append(one(mode, *bundles, a, work))
                print(f"pass {p + 1}/{a.passes} {mode}: {rows[mode][-1]}", flush=True)
    res = {"passes": a.passes, "kv_cache_gib": a.kv_cache_gib, "rows": rows}
    for mode, rs in rows.items():
        for k in ("seconds", "rss_extra_mib", "rss_peak_mib"):
            v = [r[k] for r in rs]
            res[f"{mode}/{k}"] = {"median": statistics.median(v), "range": [min(v), max(v)]}
    print(json.dumps({k: v for k, v in res.items() if "/" in k}, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=2))
