"""Adaptive num_draft_tokens (k) and the speculation off-switch, per workload class.

Cost model (Leviathan et al. 2023, arXiv 2211.17192 §3.4, with measured costs instead of a
constant ratio): one speculative step with k drafts emits τ(k) = 1 + Σ_{i≤k} Π_{j≤i} a_j tokens
on average, where a_j is the conditional acceptance at draft position j, and costs
T_target(k+1) + k·T_draft (k-1 chain steps plus the draft's catch-up over the verified rows).
k = 0 is plain decoding: 1 token per T_target(1). The policy picks argmax_k τ(k) / cost(k) over
k ≥ 1, and keeps speculation on only if that beats plain decoding by `margin` (default 5 %): near
break-even the prediction's error (a few steps of acceptance, step costs that move with load)
is larger than the gain, and a wrong "on" costs up to the whole draft overhead.

a_j is a running mean, then (after 1/alpha observations) an EMA, per workload class over verify
steps that reached position j; the step costs start
from a calibration measured at start-up (cached per machine + target) and then follow an EMA of
the measured single-request step times, so a noisy calibration or a loaded machine corrects itself.
A class with
speculation off still probes every `probe_every`-th step (with the best k ≥ 1), so a draft that
improves (hot-swap) or a workload that turns structured is noticed.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..models import eagle3, target
from .stats import simulated_acceptance_length


@dataclass(frozen=True)
class Calibration:
    """Measured costs (ms) on this machine: target_ms[n-1] = one target forward of n tokens
    (n = 1..k_max+1, batch 1, at `context` cached tokens); draft_ms = one draft chain step."""

    target_ms: tuple[float, ...]
    draft_ms: float
    key: str
    context: int

    def __post_init__(self):
        ms = [*self.target_ms, self.draft_ms]
        if len(self.target_ms) < 2 or not all(isinstance(x, (int, float)) and math.isfinite(x) for x in ms) \
                or min(self.target_ms) <= 0 or self.draft_ms < 0:
            raise ValueError("calibration needs target_ms for 1..k_max+1 tokens (k_max >= 1), all finite and > 0, "
                             "and draft_ms >= 0; delete the cached file to measure again")

    @property
    def k_max(self) -> int:
        return len(self.target_ms) - 1

    def step_ms(self, k: int) -> float:
        """Predicted wall time (ms) of one decode step with k drafts (k = 0: no speculation)."""
        return self.target_ms[k] + (k * self.draft_ms if k else 0.0)


def _cpu_model() -> str:
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
    for mod in (target, eagle3):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()[:12]


def calibration_key(target, runner, k_max: int) -> str:
    """Machine + code + target + draft shape + threads: a calibration is reused only where it was measured."""
    d = runner.config if runner is not None else None
    parts = [_cpu_model(), os.cpu_count(), torch.get_num_threads(), torch.__version__, _code_hash(), target.target_id,
             target.cfg.hidden_size, target.cfg.num_layers, str(target.dtype), k_max,
             (d.hidden_size, d.intermediate_size, d.draft_vocab_size) if d else None]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def _min_ms(fn, reps: int) -> float:
    """Fastest of `reps` runs (ms): on a shared machine the minimum is the least disturbed."""
    fn()  # warm-up
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(1000 * (time.perf_counter() - t))
    return min(ts)


@torch.inference_mode()
def calibrate(target, runner, k_max: int, context: int = 128, reps: int = 7) -> Calibration:
    """Time target forwards of 1..k_max+1 tokens and one draft step (fastest of `reps`).
    Raises ValueError for k_max < 1."""
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    g = torch.Generator().manual_seed(0)
    V = target.cfg.vocab_size
    cache = target.new_cache(context + k_max + 2)
    target.forward(torch.randint(0, V, (context,), generator=g), cache, need_hidden=False)

    def tgt(n):
        ids = torch.randint(0, V, (n,), generator=g)

        def f():
            cache.length = context
            target.forward(ids, cache, need_hidden=True)
        return f

    fns = [tgt(n) for n in range(1, k_max + 2)]
    best = [_min_ms(f, 1) for f in fns]
    for _ in range(reps):  # round-robin, so a burst of load hits every size, not one
        best = [min(b, _min_ms(f, 1)) for b, f in zip(best, fns)]
    tms = tuple(max(best[:i + 1]) for i in range(len(best)))  # a longer verify is never cheaper
    dms = 0.0
    if runner is not None:
        dc = runner.new_cache(context + 2)
        aux = torch.randn(context, 3 * target.cfg.hidden_size, generator=g)
        runner.extend(aux, torch.randint(0, V, (context,), generator=g), dc)
        h = torch.randn(1, runner.config.hidden_size, generator=g)
        tok = torch.tensor([1])

        def dstep():
            dc.length = context
            runner.step_batch([(h, tok, dc)])
        dms = _min_ms(dstep, reps * 4)
    return Calibration(tms, dms, calibration_key(target, runner, k_max), context)


def load_or_calibrate(target, runner, k_max: int, cache_dir: Path | None) -> Calibration:
    """Calibration cached as JSON under `cache_dir/calibration/<key>.json` (measured once per machine)."""
    key = calibration_key(target, runner, k_max)
    path = Path(cache_dir) / "calibration" / f"{key}.json" if cache_dir else None
    if path is not None and path.exists():
        try:
            d = json.loads(path.read_text())
            return Calibration(tuple(d["target_ms"]), d["draft_ms"], d["key"], d["context"])
        except (ValueError, KeyError, TypeError):  # corrupt or foreign file: measure again
            path.unlink(missing_ok=True)
    cal = calibrate(target, runner, k_max)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(cal), indent=2))
        tmp.replace(path)
    return cal


def predicted_tau(acc: list[float], k: int) -> float:
    """τ(k) = 1 + Σ_{i≤k} Π_{j≤i} a_j from conditional per-position acceptance `acc` (first k used)."""
    return simulated_acceptance_length(acc[:k])


def _argmax(xs: list[float], lo: int = 0) -> int:
    return max(range(lo, len(xs)), key=xs.__getitem__)


class AdaptiveK:
    """Chooses k per workload class from an EMA of conditional per-position acceptance.

    prior: initial a_j for an unseen class (optimistic, so a new class tries speculation);
    alpha: EMA weight of one observation (the first 1/alpha observations are averaged);
    probe_every: with speculation off, every n-th step of the class runs the best k ≥ 1 to keep
    the estimate fresh; margin: the predicted gain over plain decoding (0.05 = 5 %) below which
    speculation stays off. Thread-safe.
    """

    def __init__(self, calibration: Calibration, prior: float = 0.6, alpha: float = 0.05,
                 probe_every: int = 32, margin: float = 0.05):
        if not 0 <= prior <= 1 or not 0 < alpha <= 1 or probe_every < 1 or not 0 <= margin < 1:
            raise ValueError("AdaptiveK needs 0 <= prior <= 1, 0 < alpha <= 1, probe_every >= 1, 0 <= margin < 1")
        self.cal = calibration
        self.k_max = calibration.k_max
        self.prior, self.alpha, self.probe_every, self.margin = prior, alpha, probe_every, margin
        self._acc: dict[str, list[float]] = {}
        self._obs: dict[str, list[int]] = {}  # observations per position (running mean until 1/alpha)
        self._steps: dict[str, int] = {}
        self._ms: dict[int, float] = {}  # EMA of measured single-request step ms, per k
        self._load = 1.0  # EMA of measured / calibrated, scales the k not measured yet
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Forget acceptance and measured step times (after a draft hot-swap); keep the load factor."""
        with self._lock:
            self._acc.clear()
            self._obs.clear()
            self._steps.clear()
            self._ms.clear()

    def acceptance(self, workload: str) -> list[float]:
        with self._lock:
            return list(self._acc.get(workload, [self.prior] * self.k_max))

    def predicted_tokens_per_s(self, workload: str) -> list[float]:
        """Predicted tokens/s for k = 0..k_max."""
        acc = self.acceptance(workload)
        ms = self.step_ms()
        return [1000 * predicted_tau(acc, k) / ms[k] for k in range(self.k_max + 1)]

    def step_ms(self) -> list[float]:
        """Current cost estimate (ms) of one step with k = 0..k_max drafts.

        Each k's EMA is measured separately, so a load spike during k = 0 steps could make plain
        decoding look dearer than verifying k + 1 tokens after k draft steps — physically
        impossible, and it made the policy predict speed-ups far above τ (3.9× at τ 1.05 on a noisy
        machine). Load scales every k alike, so a step with k drafts is floored at the k = 0
        estimate times the calibrated ratio T(k)/T(0) (and at the estimate for k − 1): the
        predicted speed-up is then at most τ(k) · T_cal(0)/T_cal(k) whatever the spikes."""
        with self._lock:
            ms = [self._ms.get(k, self.cal.step_ms(k) * self._load) for k in range(self.k_max + 1)]
        for k in range(1, len(ms)):
            ms[k] = max(ms[k], ms[k - 1], ms[0] * self.cal.step_ms(k) / self.cal.step_ms(0))
        return ms

    def observe_time(self, k: int, ms: float, alpha: float = 0.1) -> None:
        """A measured single-request step with k drafts took `ms` (batched steps are not comparable).

        Updates that k's EMA and the machine-load factor applied to the k not measured yet."""
        if 0 <= k <= self.k_max and math.isfinite(ms) and ms > 0:
            with self._lock:
                prev = self._ms.get(k, self.cal.step_ms(k) * self._load)
                ms = min(max(ms, 0.5 * prev), 2.0 * prev)  # a load spike moves the estimate, not replaces it
                self._ms[k] = prev + alpha * (ms - prev)
                self._load += alpha * (ms / self.cal.step_ms(k) - self._load)

    def _pick(self, tps: list[float]) -> int:
        k = _argmax(tps, lo=1)
        return k if tps[k] > (1 + self.margin) * tps[0] else 0

    def best_k(self, workload: str) -> int:
        """The k ≥ 1 with the highest predicted tokens/s if it beats plain decoding by `margin`,
        else 0 (speculation off); no probing."""
        return self._pick(self.predicted_tokens_per_s(workload))

    def choose(self, workload: str) -> int:
        """k for the next step of a request of this class (0 = plain decoding; with speculation
        off, every `probe_every`-th step probes the best k ≥ 1)."""
        tps = self.predicted_tokens_per_s(workload)
        k = self._pick(tps)
        with self._lock:
            n = self._steps[workload] = self._steps.get(workload, 0) + 1
        return _argmax(tps, lo=1) if k == 0 and n % self.probe_every == 0 else k

    def observe(self, workload: str, k: int, accepted: int) -> None:
        """One verify step: k drafts, the first `accepted` accepted. Updates positions 1..min(accepted+1, k)."""
        if k < 1:
            return
        with self._lock:
            acc = self._acc.setdefault(workload, [self.prior] * self.k_max)
            obs = self._obs.setdefault(workload, [0] * self.k_max)
            for j in range(min(accepted + 1, k, self.k_max)):
                obs[j] += 1
                acc[j] += max(self.alpha, 1.0 / obs[j]) * (float(j < accepted) - acc[j])

    def report(self) -> dict[str, dict]:
        """Per class: chosen k, predicted speed-up over plain decoding, conditional acceptance."""
        out = {}
        for w in list(self._acc):
            tps = self.predicted_tokens_per_s(w)
            k = self._pick(tps)
            out[w] = {"k": k, "speculation": k > 0, "predicted_speedup": tps[k] / tps[0],
                      "step_ms": [round(x, 2) for x in self.step_ms()],
                      "conditional_acceptance": [round(a, 4) for a in self.acceptance(w)]}
        return out
