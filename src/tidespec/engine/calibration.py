"""Measured step costs of this machine: target forwards by batch size and rows per request, draft
steps by batch size. The goodput policy (`engine.policy`) predicts a step's
wall time from them.

A ragged verify forward over b requests with r_i rows each costs T(b, R), R = Σ r_i (vLLM-style
flattening: every linear layer is one GEMM over the R rows, attention per request). On a CPU a
forward of few rows is bound by reading the weights, so T(1, r) is nearly flat in r, while at b = 8
a row costs ~1/4 of a request's plain step: speculation that pays alone can lose under load, which
is why costs are measured on the (b, r) grid and not as a per-request constant.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from ..models import eagle3, layers, runner
from ..models import target as target_mod
from ..models.target import Segment

VERSION = 3  # the cached file's format: a calibration of another version is measured anew
BUDGET_S = 40.0  # wall-time budget of the repeated passes (the first pass always runs): ≤ 60 s on 2 cores


def _interp(xs: tuple[float, ...] | list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear y(x) through (xs, ys) (xs increasing), extended linearly past the ends
    (never below 0); one point: constant."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_left(xs, x), 1), len(xs) - 1)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass(frozen=True)
class Calibration:
    """Measured costs (ms) on this machine.

    target_ms[n-1]: one target forward of n tokens, batch 1, at `context` cached tokens
    (n = 1..k_max+1); draft_ms: one draft chain step, batch 1. With a batch grid (`calibrate` with
    max_batch > 1): grid_ms[i][j] = a ragged forward of batch_sizes[i] requests × rows[j] new
    tokens each, draft_batch_ms[i] = one batched draft step of batch_sizes[i] requests. Without
    one, the grid is the batch-1 row. draft_shape: (hidden, intermediate, draft vocab) of the draft
    whose steps were timed, () when none was (draft costs 0 until `with_draft_costs`). Raises
    ValueError for non-finite or negative costs, target costs ≤ 0, or a grid whose batch sizes or
    rows are not strictly increasing.
    """

    target_ms: tuple[float, ...]
    draft_ms: float
    key: str
    context: int
    batch_sizes: tuple[int, ...] = ()
    rows: tuple[int, ...] = ()
    grid_ms: tuple[tuple[float, ...], ...] = ()
    draft_batch_ms: tuple[float, ...] = ()
    draft_shape: tuple[int, ...] = ()

    def __post_init__(self):
        ms = [*self.target_ms, self.draft_ms, *self.draft_batch_ms, *(x for r in self.grid_ms for x in r)]
        if len(self.target_ms) < 2 or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in ms) \
                or min(self.target_ms) <= 0 or self.draft_ms < 0 or min(ms) < 0:
            raise ValueError("calibration needs target_ms for 1..k_max+1 tokens (k_max >= 1), all finite and > 0, "
                             "and draft_ms >= 0; delete the cached file to measure again")
        if not self.batch_sizes:  # batch 1 only
            object.__setattr__(self, "batch_sizes", (1,))
            object.__setattr__(self, "rows", tuple(range(1, len(self.target_ms) + 1)))
            object.__setattr__(self, "grid_ms", (tuple(self.target_ms),))
            object.__setattr__(self, "draft_batch_ms", (self.draft_ms,))
        if len(self.grid_ms) != len(self.batch_sizes) or len(self.draft_batch_ms) != len(self.batch_sizes) \
                or any(len(r) != len(self.rows) for r in self.grid_ms):
            raise ValueError("calibration grid_ms must be batch_sizes × rows and draft_batch_ms one per batch size; "
                             "delete the cached file to measure again")
        for name, xs in (("batch_sizes", self.batch_sizes), ("rows", self.rows)):
            if any(b <= a for a, b in zip(xs, xs[1:])) or min(xs) < 1:
                raise ValueError(f"calibration {name} must be strictly increasing and >= 1, got {list(xs)}; "
                                 "delete the cached file to measure again")

    def with_draft_costs(self, draft_batch_ms: tuple[float, ...], draft_shape: tuple[int, ...]) -> Calibration:
        """This calibration with another draft's step costs (one per batch size, `measure_draft`)."""
        return replace(self, draft_ms=draft_batch_ms[0], draft_batch_ms=tuple(draft_batch_ms), draft_shape=draft_shape)

    @property
    def k_max(self) -> int:
        return len(self.target_ms) - 1

    def step_ms(self, k: int) -> float:
        """Predicted wall time (ms) of one decode step of one request with k drafts (k = 0: plain)."""
        return self.target_ms[k] + (k * self.draft_ms if k else 0.0)

    def target_cost(self, b: int, total_rows: int) -> float:
        """Predicted ms of a ragged target forward of `b` requests with `total_rows` new tokens in all
        (interpolated on the grid by rows per request, then by batch size; linear past its edges)."""
        r = total_rows / b
        per_b = [_interp(self.rows, list(row), r) for row in self.grid_ms]
        return _interp(self.batch_sizes, per_b, b)

    def draft_cost(self, b: int) -> float:
        """Predicted ms of one batched draft step (chain position) of `b` requests; 0 for b = 0."""
        return _interp(self.batch_sizes, list(self.draft_batch_ms), b) if b > 0 else 0.0


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _code_hash() -> str:
    """The forward code's identity: a calibration measured before a kernel change is not reused."""
    h = hashlib.sha256()
    for mod in (layers, target_mod, eagle3, runner):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()[:12]


def batch_grid(max_batch: int) -> tuple[int, ...]:
    """Batch sizes measured: powers of two below max_batch, and max_batch."""
    out = [b for b in (1, 2, 4, 8, 16, 32, 64) if b < max_batch]
    return tuple(out + [max_batch])


def row_grid(k_max: int, max_rows: int) -> tuple[int, ...]:
    """Rows per request measured: 1..k_max+1, and max_rows (a suffix proposal's longest) when longer."""
    return tuple(sorted(set(range(1, k_max + 2)) | {max(max_rows, k_max + 1)}))


def calibration_key(target, runner, k_max: int, max_batch: int = 1, max_rows: int = 0) -> str:
    """Machine + device + code + target + draft shape + threads + grid: a calibration is reused only
    where it was measured."""
    d = runner.config if runner is not None else None
    dev = target.device
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    parts = [VERSION, cpu_model(), str(dev), gpu, os.cpu_count(), torch.get_num_threads(), torch.__version__,
             _code_hash(),
             target.target_id, target.cfg.hidden_size, target.cfg.num_layers, target.precision, k_max,
             batch_grid(max_batch), row_grid(k_max, max_rows),
             (d.hidden_size, d.intermediate_size, d.draft_vocab_size) if d else None]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def _monotone(grid: list[list[float]]) -> list[list[float]]:
    """More rows or more requests never cost less (a disturbed minimum must not say otherwise)."""
    out = [list(r) for r in grid]
    for i in range(len(out)):
        for j in range(len(out[i])):
            out[i][j] = max(out[i][j], out[i][j - 1] if j else 0.0, out[i - 1][j] if i else 0.0)
    return out


@torch.inference_mode()
def calibrate(target, runner, k_max: int, context: int = 128, reps: int = 7, max_batch: int = 1,
              max_rows: int = 0, row_budget: int = 512, budget_s: float = BUDGET_S,
              progress: Callable[[str], None] | None = None) -> Calibration:
    """Time ragged target forwards of b requests × r rows (b in `batch_grid(max_batch)`, r in
    `row_grid(k_max, max_rows)`, b·r ≤ row_budget; larger cells extrapolate along r) and batched
    draft steps; the fastest of up to `reps` runs each, round-robin over the cells so a burst of load
    hits every cell, not one. Passes after the first stop once `budget_s` s of wall time are spent
    (the draft steps share the budget), so a loaded machine calibrates in bounded time with fewer
    repeats. `progress(message)` is told each pass. Raises ValueError for k_max < 1."""
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    g = torch.Generator().manual_seed(0)
    V = target.cfg.vocab_size
    bs, rs = batch_grid(max_batch), row_grid(k_max, max_rows)
    caches = []
    for _ in range(max(bs)):
        c = target.new_cache(context + max(rs) + 2)
        target.forward(torch.randint(0, V, (context,), generator=g), c, need_hidden=False)
        caches.append(c)

    def tgt(b, r):
        segs = [Segment(torch.randint(0, V, (r,), generator=g), c) for c in caches[:b]]

        def f():
            for c in caches[:b]:
                c.length = context
            target.forward_batch(segs, need_hidden=True)
        return f

    cells = [(i, j) for i, b in enumerate(bs) for j, r in enumerate(rs) if b * r <= max(row_budget, b * (k_max + 1))]
    fns = {c: tgt(bs[c[0]], rs[c[1]]) for c in cells}
    say = progress or (lambda _: None)
    t0 = time.perf_counter()
    say(f"timing {len(cells)} target forwards (batch {list(bs)} × rows {list(rs)}): pass 1 of ≤ {reps + 1}")
    best = {c: _min_ms(f, 1) for c, f in fns.items()}
    for i in range(reps):
        if time.perf_counter() - t0 > budget_s / 2:  # the other half is the draft's
            break
        say(f"pass {i + 2} of ≤ {reps + 1} ({time.perf_counter() - t0:.0f} s)")
        for c, f in fns.items():
            best[c] = min(best[c], _min_ms(f, 1))
    grid = []
    for i in range(len(bs)):
        js = [j for j in range(len(rs)) if (i, j) in best]
        row = [best[(i, j)] for j in js]
        grid.append([_interp([rs[j] for j in js], row, r) for r in rs])
    grid = _monotone(grid)
    if runner is not None:
        say(f"timing batched draft steps (batch {list(bs)})")
        dms = measure_draft(target, runner, bs, context, reps, budget_s=max(0.0, budget_s - (time.perf_counter() - t0)))
    else:
        dms = (0.0,) * len(bs)
    return Calibration(tuple(grid[0][:k_max + 1]), dms[0], calibration_key(target, runner, k_max, max_batch, max_rows),
                       context, bs, rs, tuple(tuple(r) for r in grid), dms, draft_shape(runner))


def draft_shape(runner) -> tuple[int, ...]:
    """(hidden, intermediate, draft vocab) of a draft runner; () for None."""
    if runner is None:
        return ()
    c = runner.config
    return (c.hidden_size, c.intermediate_size, c.draft_vocab_size)


@torch.inference_mode()
def measure_draft(target, runner, batch_sizes: tuple[int, ...], context: int = 128, reps: int = 7,
                  budget_s: float = BUDGET_S) -> tuple[float, ...]:
    """ms of one batched draft step for each batch size (fastest of ≤ 4·reps, fewer once `budget_s`
    s are spent across the sizes, at least 2 each; never decreasing with b)."""
    g = torch.Generator().manual_seed(0)
    V = target.cfg.vocab_size
    items = []
    for _ in range(max(batch_sizes)):
        dc = runner.new_cache(context + 2)
        runner.extend(torch.randn(context, 3 * target.cfg.hidden_size, generator=g),
                      torch.randint(0, V, (context,), generator=g), dc)
        items.append((torch.randn(1, runner.config.hidden_size, generator=g).to(runner.device), torch.tensor([1]), dc))

    def dstep(b):
        def f():
            for _, _, dc in items[:b]:
                dc.length = context
            runner.step_batch(items[:b])
        return f
    deadline = time.perf_counter() + budget_s
    dms = [_min_ms(dstep(b), reps * 4, deadline) for b in batch_sizes]
    return tuple(max(dms[:i + 1]) for i in range(len(dms)))


def _min_ms(fn, reps: int, deadline: float | None = None) -> float:
    """Fastest of `reps` runs (ms): on a shared machine the minimum is the least disturbed. Past
    `deadline` (perf_counter s) it stops after 2 runs."""
    fn()  # warm-up
    ts = []
    for i in range(reps):
        if i >= 2 and deadline is not None and time.perf_counter() > deadline:
            break
        t = time.perf_counter()
        fn()
        ts.append(1000 * (time.perf_counter() - t))
    return min(ts)


def load_or_calibrate(target, runner, k_max: int, cache_dir: Path | None, max_batch: int = 1,
                      max_rows: int = 0, progress: Callable[[str], None] | None = None) -> Calibration:
    """Calibration cached as JSON under `cache_dir/calibration/<key>.json` (measured once per machine,
    target, draft shape, thread count and grid; ≤ ~`BUDGET_S` s + one pass, told to `progress`)."""
    key = calibration_key(target, runner, k_max, max_batch, max_rows)
    path = Path(cache_dir) / "calibration" / f"{key}.json" if cache_dir else None
    if path is not None and path.exists():
        try:
            d = json.loads(path.read_text())
            return Calibration(tuple(d["target_ms"]), d["draft_ms"], d["key"], d["context"], tuple(d["batch_sizes"]),
                               tuple(d["rows"]), tuple(tuple(r) for r in d["grid_ms"]), tuple(d["draft_batch_ms"]),
                               tuple(d.get("draft_shape", ())))
        except (ValueError, KeyError, TypeError):  # corrupt or foreign file: measure again
            path.unlink(missing_ok=True)
    if progress:
        progress(f"calibrating this machine's step costs for the goodput policy (once; cached at {path})")
    cal = calibrate(target, runner, k_max, max_batch=max_batch, max_rows=max_rows, progress=progress)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes calibrating at once never share a temp file
        tmp.write_text(json.dumps(asdict(cal), indent=2))
        tmp.replace(path)
    return cal
