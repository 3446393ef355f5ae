"""A canary rollout judged on the same traffic (`decide`): the version under the `canary` alias,
served by the canary replicas (`serve.canary`), against the champion the stable replicas serve, over
the same time windows since the alias was set.

Every replica logs its cumulative spec-decode counters of the version it serves to that version's run
(`client.log_replica_counters`, every `serve.live_stats_s`: `backends.live.report_replica`). Here each
replica's samples since `canary_since` are differenced into increments (a drop of the counters — a
restart, a reinstall — starts them afresh), pooled per side (the canary version's run, the champion's),
and cut into windows at the same instants for both sides: a window closes at the first sample time
at which each side has counted at least `min_drafts` drafts since the last cut (the windows agree to
the resolution of the replicas' logging interval). A shift of traffic moves both sides of a window
alike; only a canary that is worse on the same traffic is rolled back.

The rule is the live guard's (`serve.guard`), with the stable side as the reference:
a window is *worse* when `serve.guard.below_reference(canary, stable, z)` (τ_stable − τ_canary > z ·
sqrt(SE_canary² + SE_stable²), z = `engine.spec_counters.Z`, windows of `WINDOW_DRAFTS` drafts);
`confirm` (`serve.guard.CONFIRM`) worse windows in a row → **roll back**; after `windows` windows
(`deploy.canary_windows`) the pooled windows decide: not clearly below → **promote**, clearly below →
**roll back**; else **wait**, until `max_wait_s` after the alias was set: then **roll back** (a
canary's traffic that drafts too little with its draft cannot show that it is not worse; the
champion keeps serving and the reason gives each side's drafts). The windows are walked in order,
so the verdict does not depend on when the decision runs. Acting moves the registry
(`decisions.end_canary`: audited on both versions).
More: docs/serving.md ("Canary rollout").
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from ...engine.spec_counters import WINDOW_DRAFTS, SpecDecodeCounters, Z
from ...serve.guard import CONFIRM, NONE_YET, below_reference
from .client import ModelVersionInfo, _client, canary, champion, model_name, replica_counters, replica_rows, utc
from .decisions import CANARY_SINCE_TAG, end_canary

PROMOTE, ROLL_BACK, WAIT, NO_CANARY = "promote", "roll_back", "wait", "none"
Sample = tuple[int, SpecDecodeCounters]  # (ms since the epoch, cumulative counters)


@dataclass(frozen=True)
class Window:
    """One window of the same traffic: each side's drafts in it (pooled over its replicas), when it
    closed (ms since the epoch), and whether the canary was clearly below the stable side."""

    canary: SpecDecodeCounters
    stable: SpecDecodeCounters
    end_ms: int
    worse: bool


@dataclass(frozen=True)
class Rollout:
    """What `decide` found: `verdict` (promote | roll_back | wait | none: no canary), why (`reason`, the
    figures), the canary and champion versions, where the windows start (`since_ms`), the windows, and
    whether the registry was moved (`acted`)."""

    verdict: str
    reason: str
    canary: str | None = None
    champion: str | None = None
    since_ms: int | None = None
    windows: tuple[Window, ...] = ()
    acted: bool = False

    def summary(self) -> dict:
        """A JSON-able view (`tidespec rollout status`): τ ± SE and drafts per side per window."""
        def side(x: SpecDecodeCounters) -> dict:
            return {"tau": x.acceptance_length, "se": x.acceptance_length_se, "drafts": x.num_drafts}
        return {"verdict": self.verdict, "reason": self.reason, "canary": self.canary, "champion": self.champion,
                "since": utc(self.since_ms) if self.since_ms else None, "acted": self.acted,
                "windows": [{"end": utc(w.end_ms), "canary": side(w.canary), "stable": side(w.stable),
                             "worse": w.worse} for w in self.windows]}


def replica_samples(tracking_uri: str, run_id: str, since_ms: int = 0) -> dict[str, list[Sample]]:
    """{replica id: its samples logged to `run_id` at or after `since_ms`, oldest first}
    (`client.log_replica_counters`, read back by `client.replica_rows`). Raises MlflowException on
    server errors."""
    return {r: [(t, replica_counters(v)) for t, v in sorted(at.items()) if "num_drafts" in v]
            for r, at in replica_rows(tracking_uri, run_id, since_ms).items()}


def increments(samples: list[Sample]) -> list[Sample]:
    """(end time, drafts counted since the sample before) of one replica's samples; counters that went
    down (counted afresh: a restart, a reinstall) count from zero."""
    return [(t1, b if b.num_drafts < a.num_drafts else b - a) for (_, a), (t1, b) in zip(samples, samples[1:])]


def same_windows(canary_incs: list[Sample], stable_incs: list[Sample], min_drafts: int = WINDOW_DRAFTS,
                 z: float = Z) -> list[Window]:
    """The increments of both sides (each pooled over its replicas) cut at the same instants: a window
    closes at the first sample time at which each side holds at least `min_drafts` drafts since the
    last cut; an unfinished window is left for later."""
    events = sorted([(t, 0, d) for t, d in canary_incs] + [(t, 1, d) for t, d in stable_incs], key=lambda e: e[0])
    out, acc = [], [NONE_YET, NONE_YET]
    for t, group in itertools.groupby(events, key=lambda e: e[0]):
        for _, side, d in group:
            acc[side] = acc[side] + d
        if min(acc[0].num_drafts, acc[1].num_drafts) >= min_drafts:
            out.append(Window(acc[0], acc[1], t, below_reference(acc[0], acc[1], z)))
            acc = [NONE_YET, NONE_YET]
    return out


def judge(windows: list[Window], needed: int, confirm: int = CONFIRM, z: float = Z) -> tuple[str, str]:
    """(verdict, reason) over `windows` walked in order: `confirm` worse in a row → roll back; at the
    `needed`-th window the pooled windows decide (clearly below → roll back, else promote); before
    that, wait."""
    run = 0
    for n, w in enumerate(windows, 1):
        run = run + 1 if w.worse else 0
        if run >= confirm:
            return ROLL_BACK, f"window {n}: {_vs(w.canary, w.stable)}, clearly below {confirm} windows in a row"
        if n >= needed:
            c = sum((x.canary for x in windows[:n]), NONE_YET)
            s = sum((x.stable for x in windows[:n]), NONE_YET)
            if below_reference(c, s, z):
                return ROLL_BACK, f"{n} windows pooled: {_vs(c, s)}, clearly below"
            return PROMOTE, f"{n} windows pooled: {_vs(c, s)}, not clearly below"
    return WAIT, f"{len(windows)} of {needed} windows judged"


def _vs(c: SpecDecodeCounters, s: SpecDecodeCounters) -> str:
    return (f"canary τ {c.acceptance_length:.3f} ± {c.acceptance_length_se:.3f} ({c.num_drafts} drafts) vs stable "
            f"τ {s.acceptance_length:.3f} ± {s.acceptance_length_se:.3f} ({s.num_drafts} drafts) on the same windows")


def side_increments(tracking_uri: str, run_id: str | None, since_ms: int) -> list[Sample]:
    """The increments of every replica that logged to `run_id` since `since_ms`, pooled (one side)."""
    if not run_id:
        return []
    return [i for s in replica_samples(tracking_uri, run_id, since_ms).values() for i in increments(s)]


def decide(tracking_uri: str, target_id: str, windows: int, min_drafts: int = WINDOW_DRAFTS,
           confirm: int = CONFIRM, z: float = Z, act: bool = True, max_wait_s: float | None = None) -> Rollout:
    """The canary rollout's decision (module docstring): the `canary` version against the `champion`
    on the same windows since tag `canary_since` (missing — an alias set by hand —: set to now, the
    windows start there; `max_wait_s`: the wait's limit, None: none). With `act`, a promote or
    roll-back verdict moves the registry (audited; the replicas follow). Raises MlflowException on
    server errors, RegistryError when the canary moved while deciding (nothing changed)."""
    can = canary(tracking_uri, target_id)
    champ = champion(tracking_uri, target_id)
    if can is None:
        return Rollout(NO_CANARY, "no canary in the registry", None, champ.version if champ else None)
    if champ is None:
        return Rollout(WAIT, f"canary v{can.version} has no champion to be compared with: promote it by hand",
                       can.version)
    since = _since(tracking_uri, target_id, can)
    sides = side_increments(tracking_uri, can.run_id, since), side_increments(tracking_uri, champ.run_id, since)
    wins = same_windows(*sides, min_drafts, z)
    verdict, reason = judge(wins, windows, confirm, z)
    reason = f"canary v{can.version} vs champion v{champ.version}: {reason}"
    if verdict == WAIT:
        reason += f" (a window needs {min_drafts} drafts on each side)"
        if max_wait_s is not None and time.time() * 1000 - since > max_wait_s * 1000:
            drafts = [sum(c.num_drafts for _, c in side) for side in sides]
            verdict, reason = ROLL_BACK, (f"{reason}; not judged within deploy.canary_max_wait_s {max_wait_s:g} s "
                                          f"(drafts since the alias: canary {drafts[0]}, champion {drafts[1]})")
    acted = act and verdict in (PROMOTE, ROLL_BACK)
    if acted:
        end_canary(tracking_uri, target_id, can.version, reason, promote=verdict == PROMOTE)
    return Rollout(verdict, reason, can.version, champ.version, since, tuple(wins), acted)


def _since(tracking_uri: str, target_id: str, can: ModelVersionInfo) -> int:
    try:
        return int(can.tags[CANARY_SINCE_TAG])
    except (KeyError, ValueError):
        now = int(time.time() * 1000)
        _client(tracking_uri).set_model_version_tag(model_name(target_id), can.version, CANARY_SINCE_TAG, str(now))
        return now

