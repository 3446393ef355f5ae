"""`tidespec bench vocab-coverage`: how much of the target's output on real traffic a draft's vocabulary
can propose at all. An EAGLE-3 draft predicts over a reduced vocabulary (`draft.draft_vocab_size` ids,
the most frequent of its training data: `models.eagle3.build_vocab`; EAGLE-3, arXiv 2503.01840 §3, as
in SpecForge); a token outside it is never drafted, whatever the draft learned.

Traffic: captured snapshots served greedily, whose completion tokens (`loss_mask` 1) are the target's
own output. Per draft (name=DIR): the share of those tokens its `t2d` covers, per workload. Then the
size from data: for each N of `--sizes`, a vocabulary of the N most frequent completion tokens of the
first half of a workload's records (in seal order), and its coverage of the second half. Reads token
ids only (no hidden states): seconds, safe on a busy machine.

    tidespec bench vocab-coverage --snapshots .tidespec/bench-adapt/data/snapshots/<target_id> \\
        --draft static-general-1M=<DIR> --draft adapted=data/drafts/champion \\
        --out bench/results/vocab-coverage-2026-12-06
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from datetime import date
from pathlib import Path

import torch
from safetensors import safe_open

from tidespec.bench.static_baseline import parse_drafts
from tidespec.capture.snapshots import list_snapshots
from tidespec.capture.store import read_manifest, read_record
from tidespec.models.eagle3 import build_vocab
from tidespec.workspace import engine_dir


def parser() -> argparse.ArgumentParser:
    """The command line (`tidespec bench vocab-coverage` ARGS)."""
    ap = argparse.ArgumentParser(prog="tidespec bench vocab-coverage",
                                 description="The share of the target's output on captured traffic inside each "
                                             "draft's vocabulary, and the vocabulary size chosen from data.")
    ap.add_argument("--snapshots", type=Path, nargs="+", required=True,
                    help="snapshot dirs, or a target's snapshots dir (every sealed snapshot in it)")
    ap.add_argument("--draft", action="append", default=[], help="name=DIR (repeat): a draft whose t2d is measured")
    ap.add_argument("--sizes", default="1024,2048,4096,8192,16384,32768", help="vocabulary sizes N to build")
    ap.add_argument("--out", required=True, help="path prefix: writes PREFIX.json and PREFIX.md")
    return ap


def completions(snapshot_dirs: list[Path]) -> dict[str, list[torch.Tensor]]:
    """workload → the completion token ids (int64 `[n]`, `loss_mask` 1) of each record, in snapshot
    then manifest order. A dir with a `manifest.jsonl` is read as one store (a snapshot, or `bench
    static-general`'s records), else as a target's snapshots dir. Raises FileNotFoundError when none."""
    dirs = []
    for d in snapshot_dirs:
        dirs += [d] if (d / "manifest.jsonl").exists() else list_snapshots(d.parent, d.name)
    if not dirs:
        raise FileNotFoundError(f"no sealed snapshot in {', '.join(map(str, snapshot_dirs))}")
    out: dict[str, list[torch.Tensor]] = {}
    for d in dirs:
        for row in read_manifest(d):
            r = read_record(d, row, ("input_ids", "loss_mask"))
            out.setdefault(row.workload, []).append(r["input_ids"][r["loss_mask"].bool()].long())
    return out


def coverage(t2d: torch.Tensor, tokens: list[torch.Tensor]) -> float:
    """The share of `tokens` (int64 target ids) inside the draft vocabulary `t2d` (bool `[V]`)."""
    ids = torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.long)
    return float(t2d[ids].float().mean()) if len(ids) else float("nan")


def draft_t2d(path: Path) -> torch.Tensor:
    """A draft checkpoint's `t2d` (bool `[V]`); raises FileNotFoundError naming a dir without one."""
    f = engine_dir(path) / "model.safetensors"
    if not f.is_file():
        raise FileNotFoundError(f"{path}: not a draft dir (no model.safetensors in it or in its draft/)")
    with safe_open(str(f), "pt") as st:
        return st.get_tensor("t2d").bool()


def size_sweep(records: list[torch.Tensor], sizes: list[int], vocab_size: int) -> tuple[dict[int, float], int]:
    """(N → coverage of the second half of `records` by the N most frequent tokens of the first half,
    the number of distinct tokens in the first half: an N above it is padded with ids never seen there)."""
    half = max(1, len(records) // 2)
    counts = Counter(torch.cat(records[:half]).tolist())
    return {n: coverage(build_vocab(counts, n, vocab_size)[1], records[half:]) for n in sizes}, len(counts)


def _args(argv: list[str] | None) -> tuple[argparse.Namespace, dict[str, str], list[int]]:
    """Parsed arguments, the drafts {name: dir} and the sizes; exits with a usage error naming the
    option for a --draft without NAME=, a repeated name, sizes that are not positive integers, or an
    --out that is a directory."""
    ap = parser()
    a = ap.parse_args(argv)
    drafts = {name: str(path) for name, path in parse_drafts(a.draft, ap.error).items()}
    try:
        sizes = [int(x) for x in a.sizes.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--sizes {a.sizes!r}: comma-separated positive integers")
    if not sizes or min(sizes) < 1:
        ap.error(f"--sizes {a.sizes!r}: comma-separated positive integers")
    if a.out.endswith("/") or Path(a.out).is_dir():
        ap.error(f"--out {a.out}: a path prefix (PREFIX.json and PREFIX.md are written), not a directory")
    first: dict[Path, Path] = {}  # a snapshot given twice (however spelled) counts once, kept as given first
    for p in a.snapshots:
        first.setdefault(p.resolve(), p)
    a.snapshots = list(first.values())
    return a, drafts, sizes


def main(argv: list[str] | None = None) -> dict:
    """Run it; writes PREFIX.json and PREFIX.md, returns the report. Raises SystemExit (usage) for bad
    options, FileNotFoundError for a draft or snapshot that is not there, ValueError for a size above
    the target's vocabulary."""
    a, drafts, sizes = _args(argv)
    masks = {n: draft_t2d(Path(p)) for n, p in drafts.items()}
    by_w = completions(a.snapshots)
    top = max(int(torch.cat(t).max()) for t in by_w.values())
    vocab_size = next(iter(masks.values())).numel() if masks else top + 1
    if max(sizes) > vocab_size:
        raise ValueError(f"--sizes: {max(sizes)} is above the target's vocabulary of {vocab_size} ids")
    rep = {"date": date.today().isoformat(), "snapshots": [str(p) for p in a.snapshots], "drafts": drafts,
           "tokens": {w: int(sum(len(t) for t in ts)) for w, ts in by_w.items()},
           "draft_vocab_size": {n: int(m.sum()) for n, m in masks.items()},
           "coverage": {n: {w: coverage(m, ts) for w, ts in by_w.items()} for n, m in masks.items()},
           "size_sweep": {}, "distinct_first_half": {}}
    for w, ts in by_w.items():
        if len(ts) >= 2:
            rep["size_sweep"][w], rep["distinct_first_half"][w] = size_sweep(ts, sizes, vocab_size)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(rep, indent=2))
    Path(a.out + ".md").write_text(markdown(rep, sizes))
    print(Path(a.out + ".md").read_text())
    return rep


def markdown(rep: dict, sizes: list[int]) -> str:
    """The report's tables."""
    ws = sorted(rep["tokens"])
    lines = [f"# Draft-vocabulary coverage of the target's output ({rep['date']})", "",
             "Completion tokens per workload: " + ", ".join(f"{w} {rep['tokens'][w]}" for w in ws) + ".", "",
             "| draft (draft ids) | " + " | ".join(ws) + " |", "|---|" + "---|" * len(ws)]
    for n, cov in rep["coverage"].items():
        lines.append(f"| {n} ({rep['draft_vocab_size'][n]}) | " + " | ".join(f"{cov[w]:.3f}" for w in ws) + " |")
    sw = sorted(rep["size_sweep"])
    lines += ["", "Built from the first half of each workload's records, measured on the second half (an N "
              "above the first half's distinct tokens is padded with ids never seen there):", "",
              "| N | " + " | ".join(sw) + " |", "|---|" + "---|" * len(sw),
              "| distinct tokens, first half | " + " | ".join(str(rep["distinct_first_half"][w]) for w in sw) + " |"]
    lines += [f"| {n} | " + " | ".join(f"{rep['size_sweep'][w][n]:.3f}" for w in sw) + " |" for n in sizes]
    return "\n".join(lines) + "\n"
