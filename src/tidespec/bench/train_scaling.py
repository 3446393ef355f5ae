"""`tidespec bench train-scaling`: the train step at 1 and 2 ranks, and its peak RSS against the
snapshot's size — `tidespec stage train` in fresh processes, on synthetic snapshots of the
configured target (random hidden states at its width: the teacher logits and the draft are the
real sizes, the data means nothing, so no τ is reported).

Throughput arms (one snapshot of `tokens` tokens, 1 epoch, `passes` interleaved passes):
`1 rank × 1 thread`, `1 rank × 2 threads`, `2 ranks × 1 thread` (gloo). Reported: the trainer's
tokens/s (its own `train_tokens_per_s`: optimizer steps only) and the stage's wall time, medians
and ranges, and the paired ratio of each arm to `1 rank × 1 thread` per pass. Scaling efficiency
= tokens/s at 2 ranks / (2 × tokens/s at 1 rank), each rank one thread.

Memory arms (one pass): snapshots of 1×, 2× and 4× `tokens` streamed through `train.buffer_mb`
= `buffer_mb`, and the 1× and 2× held whole (buffer 64 GiB, the trainer before streaming): peak
RSS (VmHWM) of the stage process. Output: `<out>/train_scaling.json` + `.md`.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from ..capture.snapshots import seal
from ..capture.writer import CaptureWriter
from ..config import CaptureParams, load_params
from ..models.hf_files import target_id
from ..steps.cycle import step_curate
from ..workspace import Workspace

PEAK = """
import atexit, sys
OUT = sys.argv[1]
def peak():
    kb = next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM'))
    open(OUT, 'w').write(str(kb))
atexit.register(peak)
sys.argv = ['tidespec', 'stage', 'train', '--root', sys.argv[2], '--params', sys.argv[2] + '/params.yaml']
from tidespec.cli import main
main()
"""


def synthetic_workspace(root: Path, params_raw: dict, n_records: int, seq_len: int, seed: int = 0) -> Workspace:
    """A workspace (params.yaml = `params_raw`) whose one sealed snapshot holds `n_records`
    records of `seq_len` tokens: random token ids, random bf16 hidden states at the target's
    width (aux `[T, 3H]`, hidden `[T, H]`), loss on the last 3/4; then curated. Hidden size and
    vocab come from the target's config (the target is loaded once for it). Raises as
    `load_params` / `get_target` for bad params or a missing target."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(params_raw))
    params = load_params(root / "params.yaml")
    from ..models.load import get_target
    cfg = get_target(params)[0].cfg
    tid = target_id(params)
    ws = Workspace(root)
    w = CaptureWriter(ws.capture_dir(tid), tid, CaptureParams(shard_max_records=16, queue_size=n_records + 1))
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(seq_len, dtype=torch.uint8)
    mask[seq_len // 4:] = 1
    H = cfg.hidden_size
    for i in range(n_records):
        w.submit({"input_ids": torch.randint(3, cfg.vocab_size, (seq_len,), generator=g, dtype=torch.int32),
                  "loss_mask": mask, "aux_hidden_states": torch.randn(seq_len, 3 * H, generator=g).bfloat16(),
                  "hidden_states": torch.randn(seq_len, H, generator=g).bfloat16()},
                 request_id=f"s{seed}-{i}", workload="code", acceptance_length=1.0, prompt_id=f"p{seed}-{i}")
    w.close()
    seal(ws.capture_dir(tid), ws.snapshots, tid)
    step_curate(ws, params, tid)
    return ws


def stage_train_peak(root: Path, env: dict[str, str] | None = None, timeout_s: float = 3600) -> tuple[float, dict]:
    """Run `tidespec stage train` on workspace `root` in a fresh process: (its peak RSS in MiB,
    the candidate's train_metrics.json). Raises RuntimeError with the output's tail on failure."""
    out = Path(root) / "peak_kb"
    r = subprocess.run([sys.executable, "-c", PEAK, str(out), str(root)], capture_output=True, text=True,
                       timeout=timeout_s, env=os.environ | (env or {}))
    if r.returncode != 0:
        raise RuntimeError(f"stage train failed ({r.returncode}): {r.stderr[-3000:]}")
    return int(out.read_text()) / 1024, json.loads((Path(root) / "data/work/candidate/train_metrics.json").read_text())


def _with_train(raw: dict, **train) -> dict:
    return raw | {"train": (raw.get("train") or {}) | train}


def _fresh(root: Path) -> None:
    """Drop the previous run's candidate (and state) so each run trains from scratch."""
    import shutil
    for p in (root / "data/work").glob("candidate*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink()


ARMS = {"1 rank × 1 thread": (1, 1), "1 rank × 2 threads": (1, 2), "2 ranks × 1 thread": (2, 1)}


def run(params_path: Path, out: Path, tokens: int, seq_len: int, passes: int, buffer_mb: float, work: Path,
        progress=print, batch_tokens: int | None = None, memory: bool = True) -> dict:
    """Both figure sets (module docstring; `memory` False: the rank arms only) on the target of
    `params_path` (`batch_tokens`: its train.batch_tokens, None: as params.yaml says); files
    `train_scaling[-b<batch_tokens>].{json,md}` under `out`."""
    base = yaml.safe_load(Path(params_path).read_text())
    base = _with_train(base, epochs=1, min_train_tokens=16, checkpoint_every=0, warm_start=False,
                       **({"batch_tokens": batch_tokens} if batch_tokens else {}))
    base["curate"] = (base.get("curate") or {}) | {"window": 1, "holdout_fraction": 0.0, "val_fraction": 0.02,
                                                   "replay_fraction": 0.0, "max_tokens": max(seq_len, 64)}
    n = max(1, tokens // seq_len)
    rows: dict[str, list[dict]] = {a: [] for a in ARMS}
    for ranks, threads in ARMS.values():
        synthetic_workspace(work / f"tp-{ranks}x{threads}", _with_train(base, nproc_per_node=ranks, threads=threads),
                            n, seq_len)
    for p in range(passes):
        for name, (ranks, threads) in ARMS.items():
            root = work / f"tp-{ranks}x{threads}"
            _fresh(root)
            peak, m = stage_train_peak(root, {"OMP_NUM_THREADS": str(threads)})
            rows[name].append({"tokens_per_s": m["train_tokens_per_s"], "train_seconds": m["train_seconds"],
                               "peak_mb": peak, "world": m["train_world_size"]})
            progress(f"pass {p + 1}/{passes} {name}: {m['train_tokens_per_s']:.0f} tokens/s")
    mem = []
    for mult, bmb in ((1, buffer_mb), (2, buffer_mb), (4, buffer_mb), (1, 65536.0), (2, 65536.0)) if memory else ():
        root = work / f"mem-{mult}-{int(bmb)}"
        ws = synthetic_workspace(root, _with_train(base, buffer_mb=bmb, threads=1), n * mult, seq_len, seed=mult)
        peak, m = stage_train_peak(root, {"OMP_NUM_THREADS": "1"})
        at_rest = sum(f.stat().st_size for f in ws.snapshots.rglob("*.safetensors*")) / 2**20
        mem.append({"snapshot_tokens": m["train_tokens"], "snapshot_mb": round(at_rest, 1), "buffer_mb": bmb,
                    "buffers": m["train_buffers"], "peak_mb": round(peak, 1)})
        progress(f"memory: {at_rest:.0f} MiB snapshot, buffer {bmb:.0f} MiB → peak {peak:.0f} MiB")
    res = {"target": base["target"], "tokens": n * seq_len, "seq_len": seq_len, "passes": passes,
           "batch_tokens": base["train"].get("batch_tokens"),
           "throughput": _summary(rows), "memory": mem, "cpus": os.cpu_count()}
    out.mkdir(parents=True, exist_ok=True)
    stem = "train_scaling" + (f"-b{batch_tokens}" if batch_tokens else "")
    (out / f"{stem}.json").write_text(json.dumps(res, indent=2))
    (out / f"{stem}.md").write_text(_markdown(res))
    return res


def _summary(rows: dict[str, list[dict]]) -> dict:
    ref = [r["tokens_per_s"] for r in rows["1 rank × 1 thread"]]
    out = {}
    for name, rs in rows.items():
        tps = [r["tokens_per_s"] for r in rs]
        ratio = [a / b for a, b in zip(tps, ref)]
        out[name] = {"tokens_per_s": statistics.median(tps), "tokens_per_s_range": [min(tps), max(tps)],
                     "ratio_vs_1x1": statistics.median(ratio), "ratio_range": [min(ratio), max(ratio)],
                     "peak_mb": statistics.median(r["peak_mb"] for r in rs)}
    two = out["2 ranks × 1 thread"]
    out["scaling_efficiency_2_ranks"] = two["ratio_vs_1x1"] / 2
    return out


def _markdown(res: dict) -> str:
    t = res["throughput"]
    lines = [f"# Train step: ranks and memory ({res['tokens']} tokens of {res['seq_len']}, batch_tokens "
             f"{res['batch_tokens']}, {res['passes']} passes, {res['cpus']} CPUs)", "",
             "| arm | tokens/s (median, range) | × 1 rank·1 thread (median, range) |", "|---|---|---|"]
    for name in ARMS:  # (peak RSS is the stage process's: under torchrun the launcher's, so not shown)
        r = t[name]
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} ({r['tokens_per_s_range'][0]:.0f}–"
                     f"{r['tokens_per_s_range'][1]:.0f}) | {r['ratio_vs_1x1']:.2f} ({r['ratio_range'][0]:.2f}–"
                     f"{r['ratio_range'][1]:.2f}) |")
    lines += ["", f"Scaling efficiency at 2 ranks (one thread each): {t['scaling_efficiency_2_ranks']:.2f}."]
    if not res["memory"]:
        return "\n".join(lines) + "\n"
    lines += ["", "| snapshot tokens | at rest MiB | buffer_mb | buffers/epoch | peak RSS MiB |",
              "|---|---|---|---|---|"]
    for m in res["memory"]:
        buf = "whole set" if m["buffers"] == 1 else f"{m['buffer_mb']:.0f}"
        lines.append(f"| {m['snapshot_tokens']} | {m['snapshot_mb']} | {buf} | {m['buffers']} | {m['peak_mb']} |")
    return "\n".join(lines) + "\n"
