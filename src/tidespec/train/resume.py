"""Training-state checkpoints so a killed run continues where it stopped.

One file `state.pt` in a state directory next to the output (never inside it: DVC deletes a
stage's outputs before rerunning it). Written to a temp name, fsynced, renamed, so a kill at any
point leaves the previous state or the new one, never a torn file. The state carries a
fingerprint of everything that decides the run (data entries, params, warm start); a state with
another fingerprint is ignored, so a changed run starts fresh instead of resuming a stale one.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from ..workspace import engine_dir


def fingerprint(*parts) -> str:
    """sha256 (16 hex) of the JSON of `parts` (params dicts, data entry lists, paths)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def records_fingerprint(records: list[dict]) -> str:
    """sha256 (16 hex) over every tensor field of every record (and its `rejected_mask` when it has one), in
    order (bf16 hashed by its bits)."""
    h = hashlib.sha256()
    for r in records:
        for f in ("input_ids", "loss_mask", "aux_hidden_states", "hidden_states", "rejected_mask"):
            if f not in r:  # rejected_mask: only where the serving draft's rejections were recorded
                continue
            t = r[f].contiguous()
            h.update((t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def weights_digest(draft_dir: Path | None) -> str | None:
    """sha256 (16 hex) of a draft dir's model.safetensors (a bundle's draft/; None → None): a warm
    start by content, not path."""
    if draft_dir is None:
        return None
    return hashlib.sha256((engine_dir(Path(draft_dir)) / "model.safetensors").read_bytes()).hexdigest()[:16]


def state_dir(out: Path) -> Path:
    """Where the training state for output dir `out` lives: `<out>.train-state/` beside it."""
    out = Path(out)
    return out.with_name(out.name + ".train-state")


def save_state(d: Path, state: dict) -> None:
    """Atomically write `state` (tensors, optimizer/scheduler state dicts, plain values)."""
    d.mkdir(parents=True, exist_ok=True)
    tmp = d / "state.pt.tmp"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, d / "state.pt")


def load_state(d: Path, fp: str) -> dict | None:
    """The saved state if it exists, reads and matches fingerprint `fp`; else None (start fresh)."""
    f = Path(d) / "state.pt"
    if not f.exists():
        return None
    try:
        st = torch.load(f, weights_only=False, map_location="cpu")  # load_state_dict places it
    except Exception:  # noqa: BLE001 - unreadable (should not happen with the atomic rename): start fresh
        return None
    return st if st.get("fingerprint") == fp else None


def clear_state(d: Path) -> None:
    """Remove a state dir (after a finished run); a missing dir is fine."""
    shutil.rmtree(d, ignore_errors=True)
