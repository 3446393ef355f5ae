"""Curate: choose a window of snapshots, filter, dedupe, split train/val/holdout, measure drift.

Output is a small JSON index (records are referenced, not copied): the train step reads the
tensors from the snapshots it names; `holdout.jsonl` beside it holds the holdout requests'
prompts (token ids) that evaluate replays. Splits are by request, grouped by prompt: the bucket
is a seeded hash of the prompt hash (request id when absent), and duplicates are dropped first,
so no prompt is in two splits, and a prompt keeps its split across cycles. Drift = Jensen–Shannon
divergence (bits, in [0, 1]) of the token distribution (prompt + generated) against the
previous curated set.
"""
from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import CurateParams
from ..engine.suffix_tree import CORPUS_FILE, newest_within, save_corpus
from ..hashing import unit_hash
from .replay_buffer import ReplayBuffer
from .snapshots import list_snapshots
from .store import CorruptShard, ManifestRow, read_manifest, read_record, write_private

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CurateResult:
    path: Path
    num_train: int
    num_val: int
    num_tokens: int
    dropped: dict[str, int]
    drift_jsd: float | None
    num_replay: int = 0
    num_holdout: int = 0
    holdout: Path | None = None


def _val_bucket(key: str, seed: int) -> float:
    return unit_hash(f"{seed}:{key}")


def split_of(entry: dict, params: CurateParams) -> str:
    """"holdout" | "val" | "train" for an index entry, from its prompt hash (or request id)."""
    b = _val_bucket(_prompt_key(entry), params.seed)
    if b < params.holdout_fraction:
        return "holdout"
    return "val" if b < params.holdout_fraction + params.val_fraction else "train"


def snapshot_token_counts(snap: Path) -> Counter:
    """Token-id counts (prompt + generated) over a snapshot's records."""
    counts: Counter = Counter()
    for row in read_manifest(snap):
        counts.update(read_record(snap, row, ("input_ids",))["input_ids"].tolist())
    return counts


def snapshot_drift(snap: Path, curated: Path) -> float | None:
    """JSD (bits) of a snapshot's token distribution vs the curated index `curated` (None if absent)."""
    if not Path(curated).exists():
        return None
    prev = json.loads(Path(curated).read_text()).get("token_counts", {})
    return jsd_bits(snapshot_token_counts(snap), Counter({int(k): v for k, v in prev.items()}))


def jsd_bits(a: Counter, b: Counter) -> float:
    """Jensen–Shannon divergence (base 2, in [0, 1]) between two count distributions."""
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        return 0.0
    out = 0.0
    for t in set(a) | set(b):
        p, q = a.get(t, 0) / na, b.get(t, 0) / nb
        m = (p + q) / 2
        if p:
            out += 0.5 * p * math.log2(p / m)
        if q:
            out += 0.5 * q * math.log2(q / m)
    return out


def _scan(snap: Path, target_id: str, params: CurateParams, seen: set, dropped: Counter, counts: Counter,
          keep_prompt_ids: bool = True) -> list[dict]:
    """Index entries of one snapshot that pass the filters; updates `seen` (prompt keys), `dropped`
    (reason → count) and `counts` (token counts). With `keep_prompt_ids`, entries carry their prompt
    token ids (`prompt_ids`, for the holdout file). Raises ValueError on another target's rows."""
    out = []
    for row in read_manifest(snap):
        if row.target_id != target_id:
            raise ValueError(f"snapshot {snap} holds records of target {row.target_id[:12]}, not {target_id[:12]}: "
                             f"move it under {Path(snap).parent.parent / row.target_id} (drafts are per target)")
        if not params.min_tokens <= row.num_tokens <= params.max_tokens:
            dropped["length"] += 1
            continue
        key = row.prompt_hash or row.request_id
        if key in seen:
            dropped["duplicate_prompt"] += 1
            continue
        try:  # a tokens-only record (ingest.mode: online) has no hidden states to check: the trainer rebuilds them
            rec = read_record(snap, row)
        except (CorruptShard, FileNotFoundError, ValueError) as e:  # one bad shard or row must not block the cycle
            log.error("%s", e)
            dropped["unreadable"] += 1
            continue
        if not row.tokens_only and not (torch.isfinite(rec["aux_hidden_states"].float()).all()
                                        and torch.isfinite(rec["hidden_states"].float()).all()):
            dropped["non_finite"] += 1
            continue
        seen.add(key)
        counts.update(rec["input_ids"].tolist())
        e = {"snapshot": str(snap), "shard": row.shard, "offset": row.offset, "request_id": row.request_id,
             "num_tokens": row.num_tokens, "workload": row.workload, "prompt_hash": row.prompt_hash, "ts": row.ts}
        if row.tokens_only:
            e["tokens_only"] = True
        if row.rejected is not None:  # where the serving draft was rejected (`train.rejected_weight`)
            e["rejected"] = row.rejected
        if keep_prompt_ids:
            e["prompt_ids"] = rec["input_ids"][rec["loss_mask"] == 0].tolist()
            if row.constraint is not None:  # evaluate replays it under the same grammar
                e["constraint"] = row.constraint
        out.append(e)
    return out


def replay_buffer_path(snapshots_root: Path, target_id: str) -> Path:
    """A target's replay buffer file: `<snapshots_root>/../replay/<target_id>.json` (data/replay/)."""
    return Path(snapshots_root).parent / "replay" / f"{target_id}.json"


def curate(snapshots_root: Path, target_id: str, params: CurateParams, out: Path,
           previous: Path | None = None) -> CurateResult:
    """Build the curated index `out` (JSON) and `out.parent/holdout.jsonl` from the newest
    `params.window` snapshots of `target_id`, mixed with the replay buffer.

    Drops (counted by reason): too short/long, duplicate prompt (newest kept), non-finite hidden
    states, unreadable (a corrupt or missing shard: logged with the fix, the rest is curated).
    Splits: holdout, replayed by evaluate (`holdout_split: random`: the prompt-hash bucket of
    `holdout_fraction`, see the module docstring; `time`: the newest `holdout_fraction` of the
    window's requests by capture time, so the gate scores traffic newer than all it trains on); at
    most `max_holdout` of them are replayed and the rest of the holdout is not trained on either; val
    (`val_fraction`, by prompt hash); train. Replay: snapshots that left the window enter the
    target's buffer (`replay_buffer_path`: data/replay/<target_id>.json; `curate.replay_tokens`
    per workload class, `capture.replay_buffer.ReplayBuffer`) and
    `replay_fraction` of the training tokens are drawn from it, classes in equal shares (entries
    tagged `"replay": true`; no prompt of the window is drawn). Raises ValueError when no snapshot
    exists for the target (the fix: capture traffic and seal a snapshot first) or when a snapshot
    holds another target's records.
    """
    all_snaps = list_snapshots(snapshots_root, target_id)
    snaps, older = all_snaps[-params.window:], all_snaps[:-params.window]
    if not snaps:
        raise ValueError(f"no sealed snapshots for target {target_id[:12]} under {snapshots_root}; "
                         "serve traffic with capture on and seal a snapshot first")
    dropped: Counter = Counter()
    counts: Counter = Counter()
    seen: set = set()
    chosen: list[dict] = []
    for snap in reversed(snaps):  # newest first, so dedupe keeps the newest
        chosen += _scan(snap, target_id, params, seen, dropped, counts)
    parts = _split(chosen, params)
    train, val = parts["train"], parts["val"]
    holdout = parts["holdout"][:params.max_holdout]
    for r in train + val:
        r.pop("prompt_ids", None)
        r.pop("constraint", None)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    replay, replay_dropped, buffer_summary, retained = _replay(snapshots_root, target_id, params, older, snaps, seen,
                                                              sum(r["num_tokens"] for r in train), out.parent)
    train += replay
    drift = None
    if previous and Path(previous).exists():
        prev = json.loads(Path(previous).read_text())
        drift = jsd_bits(counts, Counter({int(k): v for k, v in prev.get("token_counts", {}).items()}))
    hold_path = out.with_name("holdout.jsonl")  # prompts (token ids): private, like the snapshots
    write_private(hold_path, "".join(json.dumps({"id": r["request_id"], "workload": r["workload"],
                                                 "input_ids": r["prompt_ids"], "prompt_hash": r["prompt_hash"]}
                                                | ({"constraint": r["constraint"]} if "constraint" in r else {})) + "\n"
                                     for r in holdout).encode())
    holdout_index = [{k: v for k, v in r.items() if k not in ("prompt_ids", "constraint")} for r in holdout]
    for r in train[:len(train) - len(replay)] + val + holdout_index:  # relative to the index: any clone reads it
        r["snapshot"] = os.path.relpath(r["snapshot"], out.parent)
    index = {"target_id": target_id, "snapshots": [os.path.relpath(s, out.parent) for s in snaps],
             "replay_snapshots": sorted({r["snapshot"] for r in replay}),
             "train": train, "val": val, "holdout": holdout_index, "holdout_split": params.holdout_split,
             "num_replay": len(replay), "replay_buffer": buffer_summary, "retained_holdout": retained,
             "dropped": dict(dropped), "replay_dropped": dict(replay_dropped), "drift_jsd": drift,
             "workload_mix": dict(Counter(r["workload"] for r in train)),
             "token_counts": {str(k): v for k, v in counts.items()}}
    write_private(out, json.dumps(index).encode())
    return CurateResult(out, len(train), len(val), sum(r["num_tokens"] for r in train), dict(dropped), drift,
                        len(replay), len(holdout), hold_path)


def _split(chosen: list[dict], params: CurateParams) -> dict[str, list[dict]]:
    """{"train", "val", "holdout"} of the window's deduplicated entries (`curate`'s docstring); the
    holdout in replay order (random: a seeded order; time: newest first)."""
    parts: dict[str, list[dict]] = {"train": [], "val": [], "holdout": []}
    if params.holdout_split == "time":
        newest = sorted(chosen, key=lambda r: (Path(r["snapshot"]).name, r["ts"], r["offset"]), reverse=True)
        n = round(params.holdout_fraction * len(newest))
        parts["holdout"] = newest[:n]
        held = {id(r) for r in parts["holdout"]}
        for r in chosen:
            if id(r) not in held:
                parts["val" if _val_bucket(_prompt_key(r), params.seed) < params.val_fraction else "train"].append(r)
        return parts
    for r in chosen:
        parts[split_of(r, params)].append(r)
    parts["holdout"].sort(key=lambda r: _val_bucket("order:" + r["request_id"], params.seed))
    return parts


def _prompt_key(entry: dict) -> str:
    return entry.get("prompt_hash") or entry["request_id"]


def _trainable(entry: dict, params: CurateParams) -> bool:
    """True for an entry of a snapshot that left the window that may be trained on: the train bucket
    (`holdout_split: random`: a prompt keeps its split for good), or anything but val (`time`: the
    holdout was the newest traffic of its day)."""
    if params.holdout_split == "random":
        return split_of(entry, params) == "train"
    return _val_bucket(_prompt_key(entry), params.seed) >= params.val_fraction


def _replay(snapshots_root: Path, target_id: str, params: CurateParams, older: list[Path], snaps: list[Path],
            seen: set, train_tokens: int, base: Path) -> tuple[list[dict], Counter, dict, dict]:
    """Absorb the snapshots that left the window into the target's replay buffer (their entries never
    trained on, `_trainable`'s complement, as its retained holdout), then draw `replay_fraction` of
    the training set from it (`ReplayBuffer`). Returns (replay entries, drops while absorbing, the
    buffer's {class: {records, tokens}}, the retained holdout {class: entries relative to `base`})."""
    dropped: Counter = Counter()
    buf = ReplayBuffer(replay_buffer_path(snapshots_root, target_id), params.seed)
    with buf.lock():
        buf = ReplayBuffer(buf.path, params.seed)  # read under the lock
        fresh = [s for s in older if s.name not in buf.absorbed]
        for snap in fresh:
            pool = _scan(snap, target_id, params, set(), dropped, Counter(), keep_prompt_ids=False)
            buf.absorb(snap.name, [r for r in pool if _trainable(r, params)], params.replay_tokens,
                       held=[r for r in pool if not _trainable(r, params)], held_budget=params.retained_holdout_tokens)
        gone = {p.name[:-4] for p in (Path(snapshots_root) / target_id).glob("*.dvc")} - {s.name for s in older + snaps}
        if gone := {g for g in gone if g < snaps[0].name} - buf.absorbed:  # dropped by retention before a curate saw it
            log.warning("replay: %d snapshot(s) left local disk before entering the replay buffer (%s...): keep "
                        "capture.keep_local_snapshots above curate.window by the seals between two cycles",
                        len(gone), min(gone))
            dropped["not_local"] += len(gone)
            buf.absorbed |= gone  # counted once
        if fresh or gone or not buf.path.exists():
            buf.save()
    want = train_tokens * params.replay_fraction / (1 - params.replay_fraction)
    retained = buf.retained(base, seen) if params.retained_holdout_tokens else {}
    return (buf.draw(want, seen, base) if want > 0 else []), dropped, buf.summary(), retained


def class_subset(index: Path, workload: str, replay_fraction: float, seed: int, out: Path) -> CurateResult:
    """A workload class's curated set `out` (+ `out.parent/holdout.jsonl`) for its own draft, from the
    cycle's curated index `index`: the class's train, val and holdout entries (its replay-buffer
    entries stay tagged `"replay": true`), plus `replay_fraction` of its training tokens drawn from
    the other classes' training entries in a seeded order (tagged replay: a class draft keeps some of
    what the generalist knows; same nearest-total rule as `ReplayBuffer.draw`), and the class's own
    retained holdout. Window and lineage are the index's. Raises FileNotFoundError for a missing index
    or holdout file."""
    index, out = Path(index), Path(out)
    idx = json.loads(index.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)

    def moved(e: dict, **extra) -> dict:  # paths relative to the new index
        return dict(e, snapshot=os.path.relpath(index.parent / e["snapshot"], out.parent), **extra)

    train = [moved(e) for e in idx["train"] if e.get("workload") == workload]
    others = sorted((e for e in idx["train"] if e.get("workload") != workload),
                    key=lambda e: _val_bucket(f"class-replay:{workload}:{e['request_id']}", seed))
    want = sum(e["num_tokens"] for e in train) * replay_fraction / (1 - replay_fraction)
    total = 0
    for e in others:
        if total + e["num_tokens"] / 2 >= want:
            break
        train.append(moved(e, replay=True))
        total += e["num_tokens"]
    val = [moved(e) for e in idx["val"] if e.get("workload") == workload]
    holdout = [moved(e) for e in idx["holdout"] if e.get("workload") == workload]
    rows = [r for r in (json.loads(line) for line in index.with_name("holdout.jsonl").read_text().splitlines())
            if r.get("workload") == workload]
    hold_path = out.with_name("holdout.jsonl")
    write_private(hold_path, "".join(json.dumps(r) + "\n" for r in rows).encode())
    rel = [os.path.relpath(index.parent / s, out.parent) for s in idx["snapshots"]]
    sub = idx | {"snapshots": rel, "train": train, "val": val, "holdout": holdout, "workload": workload,
                 "replay_snapshots": sorted({e["snapshot"] for e in train if e.get("replay")}),
                 "num_replay": sum(bool(e.get("replay")) for e in train),
                 "workload_mix": dict(Counter(e["workload"] for e in train)),
                 "retained_holdout": {w: [moved(e) for e in es] for w, es in idx.get("retained_holdout", {}).items()
                                      if w == workload}}  # a class draft answers for its own class
    write_private(out, json.dumps(sub).encode())
    return CurateResult(out, len(train), len(val), sum(e["num_tokens"] for e in train), {}, idx.get("drift_jsd"),
                        sub["num_replay"], len(rows), hold_path)


def load_records(
    entries: list[dict], base: Path, fields: tuple[str, ...] | None = None,
    locate: Callable[[Path], Path] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Read the tensors of curated index entries (all, with `rejected_mask` where the entry has
    `rejected`, or only `fields`); `base`: the index's
    directory (entry paths are relative to it); `locate`: maps a shard's path to the local file
    holding it (`adapters.versioning.RemoteShards.locate`: fetched from the DVC remote when the
    workspace lacks it; None: the path itself). To go over a large set, read and drop one record
    at a time (`output_sequences`, `train.source.IndexRecords`) instead of holding the list."""
    out = []
    for e in entries:
        path = Path(base) / e["snapshot"] / e["shard"]
        path = locate(path) if locate else path
        row = ManifestRow(request_id=e["request_id"], ts="", workload=e.get("workload", ""), target_id="",
                          num_tokens=e["num_tokens"], acceptance_length=0.0, shard=path.name, offset=e["offset"],
                          tokens_only=bool(e.get("tokens_only")), rejected=e.get("rejected"))
        out.append(read_record(path.parent, row, *((fields,) if fields else ())))
    return out


def output_sequences(index: Path, locate: Callable[[Path], Path] | None = None) -> list[list[int]]:
    """The served outputs (the loss-masked tokens: what the target generated) of a curated index's
    train and val requests, oldest snapshot first — the global suffix tree a cycle deploys with its
    draft. Holdout requests (evaluation) and replayed older ones are left out; `locate` as in
    `load_records`. Raises
    FileNotFoundError / CorruptShard as `read_record`."""
    idx = json.loads(Path(index).read_text())
    rank = {snap: i for i, snap in enumerate(idx["snapshots"])}  # the window, oldest first
    entries = sorted((e for e in idx["train"] + idx["val"] if not e.get("replay")),
                     key=lambda e: (rank.get(e["snapshot"], -1), e["shard"], e["offset"]))
    out = []
    for e in entries:  # one record at a time
        r = load_records([e], Path(index).parent, ("input_ids", "loss_mask"), locate)[0]
        if s := r["input_ids"][r["loss_mask"].bool()].tolist():
            out.append(s)
    return out


def write_suffix_corpus(index: Path, out: Path, max_tokens: int, locate: Callable[[Path], Path] | None = None) -> dict:
    """`<out>/suffix_corpus.safetensors`, the corpus the global suffix tree deploys with a draft: the
    served outputs of the curated index (`output_sequences`; `locate` as there), newest kept within
    `max_tokens` (engine.suffix.max_tokens, the global tree's budget). Returns
    {"suffix_corpus/sequences", "suffix_corpus/tokens"}."""
    seqs = output_sequences(index, locate)
    info = save_corpus(Path(out) / CORPUS_FILE, newest_within(seqs, max_tokens))
    return {"suffix_corpus/sequences": info["sequences"], "suffix_corpus/tokens": info["tokens"]}
