"""The replay buffer: earlier curated training data kept per workload class, so retraining keeps what it knew.

One JSON file per target (`data/replay/<target_id>.json`, beside the snapshots, private like them)
holds index entries (references to records in sealed snapshots, never tensors) grouped by class.
A snapshot enters the buffer once, when it leaves the curation window (`absorb`); its train-bucket
records are added to their class. Each class keeps at most `curate.replay_tokens` tokens: the
records with the smallest seeded hash of their request id, a bottom-k sketch, so a class's buffer is
a uniform sample of all its history, whatever the order snapshots arrived in, however many
snapshots the window holds, and whatever retention deleted locally (a shard no longer on disk is
fetched from the DVC remote by the train step, as any curated entry). `draw` mixes the buffer into
a cycle's training set: `curate.replay_fraction` of the training tokens, shared equally between the
classes (round robin), so a class absent from the window is trained on as much as one present.

Experience replay against catastrophic forgetting: Rolnick et al., "Experience Replay for Continual
Learning" (NeurIPS 2019), §3 (a reservoir buffer mixed into each update); the bottom-k sample is
Cohen & Kaplan, "Summarizing data using bottom-k sketches" (PODC 2007).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from filelock import FileLock

from ..hashing import unit_hash
from .store import write_private

VERSION = 1


def _order(entry: dict, seed: int) -> float:
    return unit_hash(f"{seed}:replay:{entry['request_id']}")


def _key(entry: dict) -> str:
    return entry.get("prompt_hash") or entry["request_id"]


class ReplayBuffer:
    """A target's buffer file (`path`), read at construction; `save` writes it atomically.

    `classes`: {class: [index entry, ...]} (entry paths relative to the buffer's directory), each in
    bottom-k order; `absorbed`: snapshot ids already added. Raises ValueError for a file of another
    format (the fix: delete it, the next cycles rebuild it from the older snapshots still on disk)."""

    def __init__(self, path: Path, seed: int):
        self.path, self.seed = Path(path), seed
        self.classes: dict[str, list[dict]] = {}
        self.held: dict[str, list[dict]] = {}
        self.absorbed: set[str] = set()
        if self.path.exists():
            raw = json.loads(self.path.read_text())
            if raw.get("version") != VERSION:
                raise ValueError(f"replay buffer {self.path} has format {raw.get('version')!r}, not {VERSION}: "
                                 "delete it (it is rebuilt from the older snapshots on disk)")
            self.classes, self.absorbed = raw["classes"], set(raw["absorbed"])
            self.held = raw.get("held", {})  # absent in a buffer saved before it was kept

    def lock(self) -> FileLock:
        """The buffer's lock: hold it from reading to `save` (two curates never interleave)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.path) + ".lock")

    def absorb(self, snapshot_id: str, entries: list[dict], budget_tokens: int, held: list[dict] = (),
               held_budget: int = 0) -> int:
        """Add a snapshot's train-bucket entries (paths absolute or relative to the cwd) to their
        classes, then keep each class within `budget_tokens` (the bottom-k rule above; a prompt seen
        twice keeps its newest record); `held`, its entries never trained on (holdout and val
        buckets), go to `self.held` the same way within `held_budget` tokens per class: the retained
        holdout a candidate's forgetting is checked on (`retained`). Idempotent per snapshot.
        Returns the training entries added."""
        if snapshot_id in self.absorbed:
            return 0
        self.absorbed.add(snapshot_id)
        self._add(self.classes, entries, budget_tokens)
        self._add(self.held, list(held), held_budget)
        return len(entries)

    def _add(self, store: dict[str, list[dict]], entries: list[dict], budget: int) -> None:
        touched = set()
        for e in entries:
            e = {k: v for k, v in e.items() if k not in ("prompt_ids", "constraint", "replay")}
            e["snapshot"] = os.path.relpath(Path(e["snapshot"]).resolve(), self.path.parent.resolve())
            workload = e.get("workload") or ""
            kept = store.setdefault(workload, [])
            kept[:] = [x for x in kept if _key(x) != _key(e)]
            kept.append(e)
            touched.add(workload)
        for workload in touched:
            store[workload] = self._within(store[workload], budget)

    def _within(self, entries: list[dict], budget: int) -> list[dict]:
        out, tokens = [], 0
        for e in sorted(entries, key=lambda e: _order(e, self.seed)):
            if tokens + e["num_tokens"] > budget:
                break
            out.append(e)
            tokens += e["num_tokens"]
        return out

    def draw(self, want_tokens: float, exclude: set[str], base: Path) -> list[dict]:
        """Entries for a training set: classes in turn (sorted by name), each giving its next entry in
        bottom-k order, while the total stays nearest `want_tokens`; an entry whose prompt is in
        `exclude` (the window's prompts: no prompt in two splits) is skipped. Entries come tagged
        `"replay": true`, their paths relative to `base` (the curated index's directory)."""
        queues = {workload: [e for e in es if _key(e) not in exclude] for workload, es in sorted(self.classes.items())}
        out, total = [], 0
        while any(queues.values()):
            for q in queues.values():
                if not q:
                    continue
                e = q.pop(0)
                if total + e["num_tokens"] / 2 >= want_tokens:
                    return out
                snap = (self.path.parent / e["snapshot"]).resolve()
                out.append(dict(e, snapshot=os.path.relpath(snap, Path(base).resolve()), replay=True))
                total += e["num_tokens"]
        return out

    def retained(self, base: Path, exclude: set[str] = frozenset()) -> dict[str, list[dict]]:
        """The retained holdout: {class: its held entries, bottom-k order}, paths relative to `base`
        (the curated index's directory), less any whose prompt is in `exclude` (the window's) or in the
        training buffer (a split setting changed since: that prompt may be trained on now)."""
        here, there = self.path.parent, Path(base).resolve()
        trained = set(exclude) | {_key(e) for es in self.classes.values() for e in es}
        out = {w: [dict(e, snapshot=os.path.relpath((here / e["snapshot"]).resolve(), there))
                   for e in es if _key(e) not in trained] for w, es in sorted(self.held.items())}
        return {w: es for w, es in out.items() if es}

    def summary(self) -> dict[str, dict[str, int]]:
        """{class: {"records", "tokens"}} held now."""
        return {workload: {"records": len(es), "tokens": sum(e["num_tokens"] for e in es)}
                for workload, es in sorted(self.classes.items())}

    def save(self) -> None:
        """Write the buffer to `path` atomically (a temporary file, 0600, then rename). Raises OSError."""
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        write_private(tmp, json.dumps({"version": VERSION, "seed": self.seed, "absorbed": sorted(self.absorbed),
                                       "classes": self.classes, "held": self.held}).encode())
        os.replace(tmp, self.path)
