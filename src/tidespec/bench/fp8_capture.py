"""`tidespec bench fp8-capture`: does storing hidden states as fp8 (`capture.hidden_dtype: fp8_e4m3`, a
scale per row; `fp8_e4m3_b32`, a scale per 32 values) change the draft trained on them?

Paired, per seed: one sealed snapshot's records split once into train and validation records; the
same warm start, params and seed train three drafts, one on the records as captured (bf16) and one
on the same records after each fp8 round trip (`capture.store.to_fp8` → `from_fp8`, what a reader
of such a shard gets); all are scored on the bf16 validation records (simulated τ at k = train.ttt_steps
and the conditional acceptance per position, `train_draft`'s holdout metrics). Writes `--out` (JSON)
and its `.md` table; prints the table.

    tidespec bench fp8-capture --snapshot data/snapshots/<target>/<sid> \\
        --init .cache/tidespec/bootstrap/static-<key> --seeds 0 1 --out bench/results/fp8-capture.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..capture.store import (
    FP8_SCALE_BLOCK,
    HIDDEN_FIELDS,
    from_fp8,
    iter_records,
    read_manifest,
    shard_hidden_dtype,
    to_fp8,
)
from ..config import load_params
from ..models.load import get_target
from ..train.trainer import train_draft


def parser() -> argparse.ArgumentParser:
    """The command line (`tidespec bench fp8-capture` ARGS)."""
    ap = argparse.ArgumentParser(prog="tidespec bench fp8-capture", description=__doc__.splitlines()[0])
    ap.add_argument("--snapshot", type=Path, required=True, help="a sealed snapshot directory (snapshot.json)")
    ap.add_argument("--init", type=Path, help="the warm start (a draft bundle or engine dir); default: none")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="draft and train settings")
    ap.add_argument("--val", type=int, default=8, help="validation records (the rest train)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="train.seed per pair")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench/results/fp8-capture.json"))
    return ap


ARMS = FP8_SCALE_BLOCK  # each fp8 hidden dtype against bf16, with its scale block


def fp8_round_trip(r: dict, block: int | None = None) -> dict:
    """Record `r` with its hidden states (`aux_hidden_states [T, 3H]`, `hidden_states [T, H]`) as a
    reader of an fp8 shard gets them back: through `to_fp8` / `from_fp8` (a scale per row, or per
    `block` values), bf16; the token fields as they are."""
    return dict(r, **{k: from_fp8(*to_fp8(r[k], block)) for k in HIDDEN_FIELDS})


def _check(a: argparse.Namespace) -> None:
    """Refuse, before the target loads, what would make the pairs meaningless (SystemExit naming the fix)."""
    if a.val < 1 or a.threads < 1:
        raise SystemExit("--val and --threads must be >= 1")
    if len(set(a.seeds)) != len(a.seeds):
        raise SystemExit(f"--seeds {a.seeds}: each seed once (a repeated pair would count twice)")
    if a.init is not None and not a.init.exists():
        raise SystemExit(f"--init {a.init}: no such draft")
    if not (a.snapshot / "snapshot.json").is_file():
        raise SystemExit(f"--snapshot {a.snapshot}: not a sealed snapshot directory (no snapshot.json in it)")
    rows = read_manifest(a.snapshot)
    if len(rows) <= a.val:
        raise SystemExit(f"--snapshot holds {len(rows)} records: more than --val {a.val} are needed")
    if any(r.tokens_only for r in rows):
        raise SystemExit(f"--snapshot {a.snapshot} holds tokens-only records (ingest.mode: online): the bench "
                         "needs captured hidden states")
    stored = {shard_hidden_dtype(a.snapshot / s) for s in {r.shard for r in rows}}
    if stored != {"bf16"}:
        raise SystemExit(f"--snapshot {a.snapshot} stores hidden states as {sorted(stored)}: the bench compares "
                         "against bf16 as captured, so it needs a snapshot captured with capture.hidden_dtype: bf16")


def main(argv: list[str] | None = None) -> None:
    """Run the pairs (`parser`); SystemExit naming the fix for a snapshot that is not one or too small."""
    a = parser().parse_args(argv)
    _check(a)
    torch.set_num_threads(a.threads)
    params = load_params(a.params)
    target, _ = get_target(params)
    recs = [r for _, r in iter_records(a.snapshot)]
    order = torch.randperm(len(recs), generator=torch.Generator().manual_seed(0)).tolist()
    val, train = [recs[i] for i in order[:a.val]], [recs[i] for i in order[a.val:]]
    runs = []
    for seed in a.seeds:
        tp = params.train.model_copy(update={"seed": seed})
        for arm, data in [("bf16", train)] + [(n, [fp8_round_trip(r, b) for r in train]) for n, b in ARMS.items()]:
            m = train_draft(data, val, target, params.draft, tp, Path(tempfile.mkdtemp()) / "draft", init=a.init)
            runs.append({"seed": seed, "arm": arm, "tau": m["simulated_acceptance_length"],
                         "cond_acc": [m[f"val/cond_acc_{j}"] for j in range(tp.ttt_steps)]})
            print(f"seed {seed} {arm}: simulated τ {m['simulated_acceptance_length']:.4f}", flush=True)
    tau = {(r["seed"], r["arm"]): r["tau"] for r in runs}
    ratios = {n: [tau[(s, n)] / tau[(s, "bf16")] for s in a.seeds] for n in ARMS}
    res = {"benchmark": "fp8-capture", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "tidespec bench fp8-capture " + " ".join(argv or []), "snapshot": str(a.snapshot),
           "init": str(a.init) if a.init else None, "train_records": len(train), "val_records": len(val),
           "train_tokens": sum(len(r["input_ids"]) for r in train), "runs": runs,
           "ratio": {n: {"median": statistics.median(q), "min": min(q), "max": max(q)} for n, q in ratios.items()}}
    md = [f"# fp8 hidden states at rest: the trained draft ({res['date'][:10]})", "",
          f"{len(train)} train / {len(val)} validation records ({res['train_tokens']} train tokens) of "
          f"`{a.snapshot}`; warm start `{res['init']}`; simulated τ on the bf16 validation records.", "",
          f"Command: `{res['command']}`", "", "| seed | bf16 τ | " + " | ".join(f"{n} τ (÷ bf16)" for n in ARMS) + " |",
          "|---|---|" + "---|" * len(ARMS)]
    md += [f"| {s} | {tau[(s, 'bf16')]:.3f} | " + " | ".join(f"{tau[(s, n)]:.3f} ({tau[(s, n)] / tau[(s, 'bf16')]:.3f})"
                                                        for n in ARMS) + " |" for s in a.seeds]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    a.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
