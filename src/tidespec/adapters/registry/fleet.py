"""One view of the fleet (`tidespec fleet status`): every replica seen in the registry for a target, from the
samples each replica logs every `serve.live_stats_s` to the run of each version it serves
(`client.log_replica_counters`: its cumulative spec-decode counters of that version, requests served,
capture backlog, last seal).

The runs read are those of the champion, the canary, the workload classes' champions and the
`RECENT_VERSIONS` newest versions. A replica's row is its newest sample across them: the version it
serves is the version whose run got that sample, its live τ the acceptance length of its counters
of that version (1 + accepted / drafts, since it started serving it), and a replica whose newest
sample is older than `STALE_ROUNDS` × `serve.live_stats_s` is stale (stopped, or cut off from the
registry). The canary column says the replica serves the `canary` version (a `serve.canary` replica
serves the champion while there is no canary). More: docs/fleet.md ("One view of the fleet").
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from mlflow.exceptions import MlflowException

from .client import (
    _client,
    _not_found,
    canary,
    champion,
    class_champions,
    model_name,
    replica_counters,
    replica_rows,
    utc,
)

RECENT_VERSIONS = 5  # the newest versions whose runs are read beside the champions' and the canary's
STALE_ROUNDS = 3  # a replica silent for more than this many serve.live_stats_s intervals is stale


@dataclass(frozen=True)
class ReplicaRow:
    """One replica as its newest sample has it: the version it serves, whether that is the canary, its
    live τ on that version (None before its first draft) over `drafts` draft-verify steps, requests
    served and capture backlog (tokens captured not yet sealed; None: not logged), its last seal (UTC
    ISO 8601; None: none known), when the sample was logged (UTC ISO 8601), its age (s) and whether
    it is stale."""

    replica_id: str
    canary: bool
    version: str
    tau: float | None
    drafts: int
    requests: int | None
    capture_backlog: int | None
    last_seal: str | None
    last_sample: str
    age_s: float
    stale: bool

    def as_dict(self) -> dict:
        """The row as JSON-able values (`tidespec fleet status --json`)."""
        return asdict(self)


def versions_read(tracking_uri: str, target_id: str, recent: int = RECENT_VERSIONS) -> dict[str, str]:
    """{version: its run id} of the champion, the canary, the class champions and the `recent` newest
    versions ({} without a registered model). Raises MlflowException on server errors."""
    c = _client(tracking_uri)
    try:
        found = c.search_model_versions(f"name='{model_name(target_id)}'")
    except MlflowException as e:
        if _not_found(e):
            return {}
        raise
    runs = {str(mv.version): mv.run_id for mv in found if mv.run_id}
    wanted = set(sorted(runs, key=int)[-recent:]) | set(class_champions(tracking_uri, target_id).values())
    wanted |= {mv.version for mv in (champion(tracking_uri, target_id), canary(tracking_uri, target_id)) if mv}
    return {v: runs[v] for v in sorted(wanted, key=int) if v in runs}


def fleet(tracking_uri: str, target_id: str, live_stats_s: float, seals: dict[str, float] | None = None,
          now_ms: int | None = None) -> list[ReplicaRow]:
    """The replicas of `target_id` (module docstring), by replica id. `live_stats_s`: the fleet's
    `serve.live_stats_s` (s, > 0); `seals`: {replica id: its newest seal, s since the epoch} from the
    DVC remote's manifests (`adapters.remote_snapshots.last_seals`; a replica missing there, or no
    `seals`, shows the last seal it logged); `now_ms`: the time ages are counted to (default now).
    Raises ValueError for `live_stats_s` ≤ 0, MlflowException on server errors."""
    if live_stats_s <= 0:
        raise ValueError("serve.live_stats_s is 0: replicas log no samples; set it to the fleet's interval (e.g. 60)")
    now = int(time.time() * 1000) if now_ms is None else now_ms
    newest: dict[str, tuple[int, int, dict[str, float]]] = {}  # replica → (time, version, values)
    for version, run_id in versions_read(tracking_uri, target_id).items():
        for replica, at in replica_rows(tracking_uri, run_id).items():
            samples = [t for t, values in at.items() if "num_drafts" in values]
            if samples and (max(samples), int(version)) > newest.get(replica, (-1, -1, {}))[:2]:
                newest[replica] = (max(samples), int(version), at[max(samples)])
    can = canary(tracking_uri, target_id)
    return [_row(r, str(v), t, values, can is not None and can.version == str(v), (seals or {}).get(r), now,
                 STALE_ROUNDS * live_stats_s) for r, (t, v, values) in sorted(newest.items())]


def _row(replica: str, version: str, t: int, values: dict[str, float], is_canary: bool, sealed: float | None,
         now_ms: int, stale_s: float) -> ReplicaRow:
    counters = replica_counters(values)

    def known(name: str) -> int | None:
        return int(values[name]) if name in values else None
    sealed = sealed if sealed is not None else values.get("last_seal")
    age = max(0.0, (now_ms - t) / 1000)
    return ReplicaRow(replica, is_canary, version, counters.acceptance_length,
                      counters.num_drafts, known("requests"), known("capture_backlog"),
                      utc(sealed * 1000) if sealed is not None else None,
                      utc(t), round(age, 1), age > stale_s)
