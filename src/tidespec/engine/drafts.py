"""The drafts an engine serves: one per workload class that has its own, and a generalist for the rest.

Each new request starts with its class's draft, else the generalist's (`ServedDrafts.route`), and
keeps it to its end (a swap never changes a running request's draft). The drafts are resident
together, within `engine.draft_memory_mb` (`DraftRunner.weight_bytes`: a one-layer EAGLE3 draft of
SmolLM2-135M with a 4096-token vocabulary holds 68 MiB resident — 28 MiB of fp32 weights, the rest
their fused and oneDNN-prepacked copies — beside the target's 540 MB; the target's embedding is
shared, so the default 1024 MiB holds the generalist and 14 class drafts). Why per
class: the gain of speculation depends on the workload, so the draft is picked per workload (the
AWS Trainium2/vLLM speculative-decoding case study; TIDE, arXiv 2602.05145 §4, adapts per domain).
"""
from __future__ import annotations

import math
import threading
from collections.abc import Mapping

from ..models.runner import DraftRunner
from ..models.target import Target

GENERALIST = ""  # the key of the generalist: serves every class without a draft of its own


def check_fits(draft: DraftRunner, target: Target) -> None:
    """Raise ValueError for a draft that does not fit `target`: vocabulary or hidden size, device, aux
    layers, or the target id it was trained for."""
    c, t = draft.config, target.cfg
    if c.vocab_size != t.vocab_size or c.target_hidden_size != t.hidden_size:
        raise ValueError(f"draft (V={c.vocab_size}, Ht={c.target_hidden_size}) does not fit the target "
                         f"(V={t.vocab_size}, H={t.hidden_size})")
    if draft.device != target.device:
        raise ValueError(f"draft on {draft.device}, target on {target.device}: place it with runner_for")
    if tuple(c.aux_layer_ids) != tuple(target.aux_layers):
        raise ValueError(f"draft aux layers {c.aux_layer_ids} != target capture layers {target.aux_layers}")
    if c.target_id and target.target_id != "unknown" and c.target_id != target.target_id:
        raise ValueError(f"draft trained for target {c.target_id[:12]}, serving {target.target_id[:12]}")


def check_replayed(replayed: Mapping[str, tuple[float, float]] | None) -> dict[str, tuple[float, float]]:
    """A draft's replayed first-token acceptance {class: (a₁, chains)} ("" = over all classes; None:
    none), as floats. Raises ValueError for an entry that is not (a₁ in [0, 1], chains >= 0)."""
    out = {}
    for w, v in (replayed or {}).items():
        try:
            a, n = (float(x) for x in v)
        except (TypeError, ValueError):
            raise ValueError(f"replayed[{w!r}] = {v!r}: expected (first-token acceptance, chains)") from None
        if not (0.0 <= a <= 1.0 and 0.0 <= n < math.inf):
            raise ValueError(f"replayed[{w!r}] = ({a}, {n}): first-token acceptance must be in [0, 1] and chains >= 0")
        out[w] = (a, n)
    return out


class ServedDrafts:
    """{class: (draft, version, replayed)} ("" the generalist), thread-safe. `budget_bytes`: the most
    the resident drafts may hold together."""

    def __init__(self, budget_bytes: int):
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._drafts: dict[str, tuple[DraftRunner, str | None, dict | None]] = {}

    def check_memory(self, workload: str, draft: DraftRunner) -> None:
        """Raise ValueError (naming `engine.draft_memory_mb`) when the resident drafts with `draft`
        serving `workload` (replacing what serves it now) would exceed the budget."""
        with self._lock:
            others = [d for w, (d, _, _) in self._drafts.items() if w != workload]
        total = sum(d.weight_bytes for d in others + [draft])
        if total > self.budget_bytes:
            raise ValueError(f"drafts would hold {total / 2**20:.0f} MiB resident (this one "
                             f"{draft.weight_bytes / 2**20:.0f} MiB, {len(others)} others), over "
                             f"engine.draft_memory_mb ({self.budget_bytes / 2**20:.0f}): raise it or serve "
                             "fewer class drafts")

    def put(self, workload: str, draft: DraftRunner | None, version: str | None,
            replayed) -> dict[str, tuple[float, float]]:
        """Serve `draft` for `workload` (None: remove it there); returns the policy's a₁ priors now
        (`priors`)."""
        with self._lock:
            if draft is None:
                self._drafts.pop(workload, None)
            else:
                self._drafts[workload] = (draft, version, dict(replayed) if replayed else None)
            return priors(self._drafts)

    def route(self, workload: str) -> tuple[DraftRunner | None, str | None]:
        """(draft, version) a new request of class `workload` starts with: its class's draft, else the
        generalist's, else (None, None)."""
        with self._lock:
            d = self._drafts.get(workload) or self._drafts.get(GENERALIST)
        return (d[0], d[1]) if d else (None, None)

    def versions(self) -> dict[str, str | None]:
        """{class: version} of every draft served ("" = the generalist)."""
        with self._lock:
            return {w: v for w, (_, v, _) in self._drafts.items()}


def priors(served: dict[str, tuple]) -> dict[str, tuple[float, float]]:
    """The goodput policy's a₁ priors when several drafts serve: each class's from the draft serving it
    (its replay's figure for that class, else its overall one; none when its draft has no replay),
    the rest ("" and the other classes) from the generalist's replay."""
    gen = (served.get(GENERALIST) or (None, None, None))[2] or {}
    out = dict(gen)
    for w, (_, _, rep) in served.items():
        if w != GENERALIST:
            rep = rep or {}
            if (a := rep.get(w, rep.get(""))) is not None:
                out[w] = a
            else:
                out.pop(w, None)
    return out
