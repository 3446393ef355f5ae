"""`tidespec bench train-ab`: learning changes, paired on traffic a draft served.

The loop's situation, at a fixed size: a draft (the champion, `--init`) serves code traffic with
capture on, and the next draft trains from it on what it served. Here:

1. snapshot (built once, cached by the target, the draft's weights, the prompts, max_new_tokens and
   k): `--init` serves `--prompts` prompts of the HumanEval train split (from `--skip` on; the demo
   serves the first 32) greedily as EAGLE-3 chains of k = engine.num_draft_tokens, capture on, so
   every record says where the target rejected its proposals (`ManifestRow.rejected`); the holdout
   split (never served) goes through the target alone: its reference outputs and records.
2. per seed, per arm (`base`: `--params` as given; `--arm NAME:train.FIELD=VALUE[,...]` changes train
   fields): a draft trained from `--init` on every served record, the same seed and data for each arm;
3. each draft replays the holdout greedily at k (τ, per-position acceptance, outputs against the
   target-only ones) and is scored teacher-forced on the holdout records (simulated τ).

Paired per seed: arm τ ÷ base τ; median, min and max over seeds. Writes `--out` (JSON) and its
`.md`; prints the table; the drafts stay under the cache (`drafts/<arm>-seed<seed>`).

    tidespec bench train-ab --init .cache/tidespec/bootstrap/static-<key> \\
        --arm w1:train.rejected_weight=1.0 --seeds 0 1 --out bench/results/train-ab-rejected.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from pathlib import Path

import torch
import yaml

from ..assets import cache_dir
from ..capture.snapshots import seal
from ..capture.store import iter_records, read_manifest
from ..config import Params, load_params
from ..models.eagle3 import load_checkpoint
from ..models.load import get_target
from ..models.runner import DraftRunner
from ..train.resume import weights_digest
from ..train.trainer import train_draft
from .train import holdout_tau, humaneval_prompts, replay_tau, serve_and_capture, write_holdout


def parser() -> argparse.ArgumentParser:
    """The command line (`tidespec bench train-ab` ARGS)."""
    ap = argparse.ArgumentParser(prog="tidespec bench train-ab", description=__doc__.splitlines()[0])
    ap.add_argument("--init", type=Path, required=True, help="the draft that serves, and every arm's warm start")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME:train.FIELD=VALUE[,...]",
                    help="an arm against base (repeatable)")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="train.seed per pair")
    ap.add_argument("--skip", type=int, default=32, help="train-split prompts left out at the start")
    ap.add_argument("--prompts", type=int, default=80, help="train-split prompts served after --skip")
    ap.add_argument("--holdout-prompts", type=int, default=24, help="holdout-split prompts replayed")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=None, help="default: the workspace's download cache")
    ap.add_argument("--out", type=Path, default=Path("bench/results/train-ab.json"))
    return ap


def parse_arm(spec: str, params: Params) -> tuple[str, Params]:
    """`NAME:train.FIELD=VALUE[,...]` → (name, params with those train fields; values read as YAML).
    Raises SystemExit naming the fix for another section, a missing name or an invalid value."""
    name, sep, body = spec.partition(":")
    if not sep or not name or name == "base" or not body:
        raise SystemExit(f"--arm {spec!r}: write NAME:train.FIELD=VALUE[,...] (NAME not 'base')")
    raw = params.model_dump()
    for item in body.split(","):
        key, eq, value = item.partition("=")
        section, dot, field = key.strip().partition(".")
        if not eq or section != "train" or not dot:
            raise SystemExit(f"--arm {spec!r}: {item!r} is not train.FIELD=VALUE (arms differ in train fields only)")
        if field not in raw["train"]:
            raise SystemExit(f"--arm {spec!r}: train has no field {field!r}")
        raw["train"][field] = yaml.safe_load(value)
    try:
        return name, Params.model_validate(raw)
    except ValueError as e:
        raise SystemExit(f"--arm {spec!r}: {e}") from e


def _check(a: argparse.Namespace, arms: list[str]) -> None:
    """Refuse, before the target loads, what would make the pairs meaningless (SystemExit naming the fix)."""
    if min(a.prompts, a.holdout_prompts, a.max_new_tokens, a.threads) < 1 or a.skip < 0:
        raise SystemExit("--prompts, --holdout-prompts, --max-new-tokens and --threads must be >= 1, --skip >= 0")
    if len(set(a.seeds)) != len(a.seeds):
        raise SystemExit(f"--seeds {a.seeds}: each seed once (a repeated pair would count twice)")
    if len(set(arms)) != len(arms):
        raise SystemExit(f"--arm names {arms}: each once")
    if not a.init.exists():
        raise SystemExit(f"--init {a.init}: no such draft")


def build(root: Path, target, runner: DraftRunner, k: int, train_p, hold_p, max_new_tokens: int,
          max_batch: int) -> dict:
    """The served snapshot (train prompts, `runner` at k) and the target-only holdout under `root`,
    reused when `root/snapshot.json` exists. Returns its metadata."""
    meta = root / "snapshot.json"
    if meta.exists():
        return json.loads(meta.read_text())
    info = {}
    for name, part, draft in (("train", train_p, runner), ("holdout", hold_p, None)):
        print(f"snapshot: serving {len(part)} {name} prompts × ≤{max_new_tokens} tokens "
              f"({'the draft at k=' + str(k) if draft else 'target only'}, capture on)", flush=True)
        res = serve_and_capture(target, part, max_new_tokens, root / f"capture-{name}", "code", max_batch,
                                draft=draft, k=k)
        s = seal(root / f"capture-{name}", root / name, target.target_id)
        rows = read_manifest(s.path)
        info[name] = {"snapshot": str(s.path), "records": s.num_records, "tokens": s.num_tokens,
                      "generated_tokens": sum(map(len, res["outputs"].values())),
                      "rejected_positions": sum(len(r.rejected or []) for r in rows),
                      "acceptance_length": res.get("acceptance_length")}
        if name == "holdout":
            write_holdout(root / "holdout.jsonl", part, res["outputs"])
    meta.write_text(json.dumps(info, indent=2))
    return info


def main(argv: list[str] | None = None) -> None:
    """Run the pairs (`parser`); SystemExit naming the fix for a bad arm, seed list or warm start."""
    a = parser().parse_args(argv)
    params = load_params(a.params)
    arms = [("base", params)] + [parse_arm(s, params) for s in a.arm]
    _check(a, [n for n, _ in arms])
    torch.set_num_threads(a.threads)
    target, tok = get_target(params)
    k, mb = params.engine.num_draft_tokens, params.engine.max_batch
    train_p, hold_p = humaneval_prompts(tok, params)
    train_p, hold_p = train_p[a.skip:a.skip + a.prompts], hold_p[:a.holdout_prompts]
    key = hashlib.sha256(json.dumps([target.target_id, weights_digest(a.init), [p for p, _ in train_p],
                                     [p for p, _ in hold_p], a.max_new_tokens, k]).encode()).hexdigest()[:12]
    root = (a.cache or cache_dir()) / "bench-train-ab" / key
    runner = DraftRunner(load_checkpoint(a.init, target.embed, target.target_id).to_device(target.device))
    snap = build(root, target, runner, k, train_p, hold_p, a.max_new_tokens, mb)
    train = [r for _, r in iter_records(Path(snap["train"]["snapshot"]))]
    hold_recs = [r for _, r in iter_records(Path(snap["holdout"]["snapshot"]))]
    holdout = [json.loads(x) for x in (root / "holdout.jsonl").read_text().splitlines()]
    runs = []
    for seed in a.seeds:
        for name, p in arms:
            p = p.model_copy(update={"train": p.train.model_copy(update={"seed": seed})})
            out = root / "drafts" / f"{name}-seed{seed}"
            m = train_draft(train, hold_recs, target, p.draft, p.train, out, init=a.init)
            ev, tf = replay_tau(target, out, holdout, k, a.max_new_tokens, mb), holdout_tau(target, out, hold_recs, p)
            runs.append({"seed": seed, "arm": name, "tau": ev["acceptance_length"], "mismatches": ev["mismatches"],
                         "accepted_per_pos": [ev[f"accepted_per_pos/{i}"] for i in range(k)],
                         "simulated_tau": tf["simulated_tau"],
                         "train_rejected_positions": m.get("train_rejected_positions"), "draft": str(out)})
            print(f"seed {seed} {name}: τ {ev['acceptance_length']:.4f} (simulated {tf['simulated_tau']:.4f}), "
                  f"mismatches {ev['mismatches']}", flush=True)
    report(a, argv, arms, runs, snap)


def report(a: argparse.Namespace, argv: list[str] | None, arms: list, runs: list[dict], snap: dict) -> None:
    """`--out` (JSON) and its `.md` table: per seed each arm's τ, and arm ÷ base paired per seed."""
    by = {(r["seed"], r["arm"]): r for r in runs}
    ratios = {n: [by[(s, n)]["tau"] / by[(s, "base")]["tau"] for s in a.seeds] for n, _ in arms[1:]}
    res = {"benchmark": "train-ab", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "tidespec bench train-ab " + " ".join(argv or []), "init": str(a.init), "snapshot": snap,
           "arms": {n: p.train.model_dump(mode="json") for n, p in arms}, "runs": runs,
           "ratio": {n: {"median": statistics.median(q), "min": min(q), "max": max(q)} for n, q in ratios.items()}}
    tr = snap["train"]
    md = [f"# Training arms, paired on served traffic ({res['date'][:10]})", "",
          f"{tr['records']} records ({tr['tokens']} tokens, {tr['rejected_positions']} rejected positions, τ "
          f"{tr['acceptance_length']:.3f}) served by `{a.init}`; holdout {snap['holdout']['records']} prompts "
          f"replayed at ≤{a.max_new_tokens} tokens.", "", f"Command: `{res['command']}`", "",
          "| seed | arm | τ (replayed) | simulated τ | mismatches | τ ÷ base |", "|---|---|---|---|---|---|"]
    for r in runs:
        q = r["tau"] / by[(r["seed"], "base")]["tau"]
        md.append(f"| {r['seed']} | {r['arm']} | {r['tau']:.3f} | {r['simulated_tau']:.3f} | {r['mismatches']} | "
                  f"{q:.3f} |")
    md += [""] + [f"{n} ÷ base: median {v['median']:.3f} (min {v['min']:.3f}, max {v['max']:.3f})"
                  for n, v in res["ratio"].items()]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    a.out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
