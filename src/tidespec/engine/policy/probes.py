"""When the goodput policy tries again what it left off (`ProbeSchedule`).

Draft probes: a class whose requests could draft with a draft model but were all left without runs
one request's best option alone when due — after `probe_every` idle steps, then twice as many while
each probe leaves it off (up to PROBE_BACKOFF × probe_every); a probe skips a request whose draft has
more than PROBE_BACKLOG prompt rows left to read, unless every one has. Offer gates: a gated
proposer's offers (the suffix proposer's) left unchosen `probe_every` steps in a row at a batch size
are computed only on probe steps there, with the same back-off; one chosen offer turns them on. A
step where none matched is not a miss. Why these numbers: docs/design/policy.md.
"""
from __future__ import annotations

import threading

PROBE_BACKLOG = 64  # a probe skips a request whose draft has more prompt rows to read (2 × default probe_every)
PROBE_BACKOFF = 16  # a class left off probes at most this many times less often than probe_every


class ProbeSchedule:
    """Draft probes and offer gates (module docstring), per (proposer kind, class). Thread-safe."""

    def __init__(self, probe_every: int = 32):
        if probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {probe_every}")
        self.every = probe_every
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Forget idle counts, back-offs and gates (a new draft serves)."""
        with self._lock:
            self._idle: dict[tuple[str, str], int] = {}  # idle steps since the last probe
            self._gap: dict[tuple[str, str], int] = {}  # idle steps between probes now (back-off)
            self._turn: dict[tuple[str, str], int] = {}  # probes run (rotates over the class's requests)
            self._gate: dict[tuple[str, str, int], list[int]] = {}  # (kind, class, batch) → [misses, gap, idle]

    def due(self, kind: str, workload: str) -> bool:
        """Count one idle step of the class; True when it is due a probe (then the next gap doubles,
        up to PROBE_BACKOFF × probe_every)."""
        key = (kind, workload)
        with self._lock:
            n = self._idle[key] = self._idle.get(key, 0) + 1
            gap = self._gap.get(key, self.every)
            if n < gap:
                return False
            self._idle[key] = 0
            self._gap[key] = min(2 * gap, PROBE_BACKOFF * self.every)
            return True

    def drafted(self, kind: str, workload: str) -> None:
        """The plan chose the kind for the class (not a probe): probing restarts at probe_every."""
        with self._lock:
            self._gap.pop((kind, workload), None)
            self._idle.pop((kind, workload), None)

    def target(self, kind: str, workload: str, idle: list[int], prompt_backlogs: list[int] | None) -> int:
        """The request a probe runs on, rotating over the class's idle requests `idle` (indices): the
        first in the rotation with at most PROBE_BACKLOG prompt rows left to read, else the one with
        the fewest (no backlogs given: the first)."""
        with self._lock:
            t = self._turn[(kind, workload)] = self._turn.get((kind, workload), -1) + 1
        j = t % len(idle)
        order = idle[j:] + idle[:j]
        if prompt_backlogs is None:
            return order[0]
        cheap = [r for r in order if prompt_backlogs[r] <= PROBE_BACKLOG]
        return cheap[0] if cheap else min(order, key=lambda r: prompt_backlogs[r])

    def offer_due(self, kind: str, workload: str, bucket: int) -> bool:
        """Compute the kind's offers for the class this step, at calibrated batch size `bucket`? Yes
        until left unchosen `probe_every` steps in a row there, then only on a probe step. Counts one
        idle step when it answers no."""
        with self._lock:
            st = self._gate.get((kind, workload, bucket))
            if st is None or st[0] < self.every:
                return True
            st[2] += 1
            if st[2] < st[1]:
                return False
            st[2] = 0
            return True

    def offered(self, kind: str, workload: str, bucket: int, chosen: bool) -> None:
        """A step that computed the kind's offers for the class: was one chosen? A miss counts towards
        the gate; a probe left unchosen doubles the gap to the next one."""
        with self._lock:
            st = self._gate.setdefault((kind, workload, bucket), [0, self.every, 0])
            if chosen:
                st[:] = [0, self.every, 0]
                return
            st[0] += 1
            if st[0] > self.every:  # it was off: this was a probe
                st[1] = min(2 * st[1], PROBE_BACKOFF * self.every)

    def gated_at(self, kind: str, workload: str) -> list[int]:
        """The batch sizes at which the kind's offers for the class are off (probed only)."""
        with self._lock:
            return sorted(
                b for (k, w, b), st in self._gate.items() if (k, w) == (kind, workload) and st[0] >= self.every
            )

    def classes(self) -> set[str]:
        with self._lock:
            return {w for _, w, _ in self._gate}
