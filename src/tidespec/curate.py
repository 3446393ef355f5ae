"""Curate: choose a window of snapshots, filter, dedupe, split validation, measure drift.

Output is a small JSON index (records are referenced, not copied): the train step reads the
tensors from the snapshots it names. Drift = Jensen–Shannon divergence (bits, in [0, 1]) of the
generated-token distribution against the previous curated set.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from .capture.store import list_snapshots, read_manifest, read_record
from .config import CurateParams


@dataclass(frozen=True)
class CurateResult:
    path: Path
    num_train: int
    num_val: int
    num_tokens: int
    dropped: dict[str, int]
    drift_jsd: float | None
    num_replay: int = 0


def _val_bucket(request_id: str, seed: int) -> float:
    h = hashlib.sha256(f"{seed}:{request_id}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2 ** 64


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
          tag: dict | None = None) -> list[dict]:
    """Index entries of one snapshot that pass the filters; updates `seen` (prompt keys), `dropped`
    (reason → count) and `counts` (generated-token counts). Raises ValueError on another target's rows."""
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
        rec = read_record(snap, row)
        if not (torch.isfinite(rec["aux_hidden_states"].float()).all()
                and torch.isfinite(rec["hidden_states"].float()).all()):
            dropped["non_finite"] += 1
            continue
        seen.add(key)
        counts.update(rec["input_ids"][rec["loss_mask"].bool()].tolist())
        out.append({"snapshot": str(snap), "shard": row.shard, "offset": row.offset, "request_id": row.request_id,
                    "num_tokens": row.num_tokens, "workload": row.workload, **(tag or {})})
    return out


def curate(snapshots_root: Path, target_id: str, params: CurateParams, out: Path,
           previous: Path | None = None) -> CurateResult:
    """Build the curated index `out` (JSON) from the newest `params.window` snapshots of `target_id`.

    Drops (counted by reason): too short/long, duplicate prompt (newest kept), non-finite hidden
    states. Replay buffer: `params.replay_fraction` of the training set is drawn (seeded, by request
    id) from the older snapshots outside the window, so a draft does not forget earlier workloads
    (entries tagged `"replay": true`; experience replay as in continual learning, e.g. Rolnick et
    al. 2019). Raises ValueError when no snapshot exists for the target (the fix: capture traffic
    and seal a snapshot first) or when a snapshot holds another target's records.
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
    train, val = [], []
    for r in chosen:
        (val if _val_bucket(r["request_id"], params.seed) < params.val_fraction else train).append(r)
    replay, replay_dropped = [], Counter()
    if params.replay_fraction > 0 and older:
        pool = []
        for snap in reversed(older):
            pool += _scan(snap, target_id, params, seen, replay_dropped, Counter(), tag={"replay": True})
        pool = [r for r in pool if _val_bucket(r["request_id"], params.seed) >= params.val_fraction]
        want = round(len(train) * params.replay_fraction / (1 - params.replay_fraction))
        replay = sorted(pool, key=lambda r: _val_bucket("replay:" + r["request_id"], params.seed))[:want]
    train += replay
    drift = None
    if previous and Path(previous).exists():
        prev = json.loads(Path(previous).read_text())
        drift = jsd_bits(counts, Counter({int(k): v for k, v in prev.get("token_counts", {}).items()}))
    index = {"target_id": target_id, "snapshots": [str(s) for s in snaps], "replay_snapshots": [str(s) for s in older],
             "train": train, "val": val, "num_replay": len(replay), "dropped": dict(dropped),
             "replay_dropped": dict(replay_dropped), "drift_jsd": drift,
             "workload_mix": dict(Counter(r["workload"] for r in train)),
             "token_counts": {str(k): v for k, v in counts.items()}}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(index))
    return CurateResult(out, len(train), len(val), sum(r["num_tokens"] for r in train), dict(dropped), drift,
                        len(replay))


def load_records(entries: list[dict]) -> list[dict[str, torch.Tensor]]:
    """Read the tensors of curated index entries."""
    from .capture.store import ManifestRow
    out = []
    for e in entries:
        row = ManifestRow(request_id=e["request_id"], ts="", workload=e.get("workload", ""), target_id="",
                          num_tokens=e["num_tokens"], acceptance_length=0.0, shard=e["shard"], offset=e["offset"])
        out.append(read_record(Path(e["snapshot"]), row))
    return out
