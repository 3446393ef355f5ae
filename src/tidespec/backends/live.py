"""Live acceptance behind a serving engine (vLLM: `backends.vllm`, SGLang: `backends.sglang`): the
served version's live figures logged to the registry (`report_live`), and acted on by the live guard
(`server_guard`: `serve.guard.LiveGuard` over the server's counters, `ServerSource`, with a
switchback trial as its evidence), on a reporter thread (`LiveReporter`). Every replica, the embedded
engine's too, logs its cumulative counters per served version under its replica id from the guard's
tracks, with its requests and capture backlog (`report_replica`, `replica_state`: what a canary rollout
is decided on and `tidespec fleet status` shows). The deployments are
`backends.base.Backend`s.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path

from ..adapters import registry
from ..engine.spec_counters import live_below_replay
from ..errors import TidespecError
from ..serve.guard import CONFIRM, REFERENCE_WINDOWS, GuardSource, LiveGuard, Rollback, Track
from ..serve.switchback import Switchback
from .base import scrape_served

# tune(per-position acceptance, drafts) → {profile: {"k", "predicted_speedup", ...}}: `steps.tuning.live_windows`
Tune = Callable[[list[float], int], dict]

log = logging.getLogger(__name__)


def report_live(dep, tracking_uri: str, target_id: str, tune: Tune | None = None) -> dict | None:
    """Scrape the serving engine's counters (`dep.scrape()`) and log them as the served version's live figures (MLflow
    run metrics `live/*`, step = drafts so far). A version whose live τ is clearly below the τ its
    evaluation replayed (`engine.spec_counters.live_below_replay`) gets tag `live_tau_below_replay` = both
    figures and a warning naming them. With `tune` (the cycle's `steps.tuning.live_windows` over
    `deploy.sagemaker`: per endpoint profile, the window tuned again from the measured per-position
    acceptance, ≥ 100 drafts): tag `live_tuned_k.<profile>` (what `tidespec deploy sagemaker` then applies) and
    metric `live/predicted_speedup/<profile>`. Returns the logged metrics, or None when there is
    nothing to log: no registry version served, or no counters exported (live τ unknown, never 0)."""
    served, now = scrape_served(dep)
    version, live = served.version, served.own(now)  # loaded in place: the version's own drafts only
    if version is None or live is None or not live.num_drafts:
        return None
    m = {"acceptance_length": live.acceptance_length, "acceptance_rate": live.acceptance_rate,
         "num_drafts": live.num_drafts, "num_draft_tokens": live.num_draft_tokens,
         "num_accepted_tokens": live.num_accepted_tokens}
    m |= {f"accepted_per_pos/{i}": r for i, r in enumerate(live.per_position_rate)}
    windows = tune(list(live.per_position_rate), live.num_drafts) if tune else {}
    m |= {f"predicted_speedup/{p}": w["predicted_speedup"] for p, w in windows.items()}
    tags = {f"live_tuned_k.{p}": str(w["k"]) for p, w in windows.items()}
    replay_tau = registry.version_tags(tracking_uri, target_id, version).get("acceptance_length")
    if replay_tau is not None and live_below_replay(live, float(replay_tau)):
        tags["live_tau_below_replay"] = f"live {live.acceptance_length:.3f} < replayed {float(replay_tau):.3f}"
        log.warning("draft v%s: live τ %.3f (±%.3f, %d drafts) is clearly below its replayed τ %s", version,
                    live.acceptance_length, live.acceptance_length_se, live.num_drafts, replay_tau)
    registry.log_live(tracking_uri, target_id, version, m, live.num_drafts, tags)
    return m | {"flagged": "live_tau_below_replay" in tags, "live_tuned_k": {p: w["k"] for p, w in windows.items()}}


class ServerSource:
    """The live guard's view of an engine server (`serve.guard.GuardSource`): one track ("", "") —
    the version `dep` serves, its own counters since it was loaded (`ServedDraft.own`), the version
    served before it the first time it appeared —; `reload` and `install` drive `dep` (the engine
    dirs of the versions it has served, as served)."""

    KEY = ("", "")

    def __init__(self, dep):
        self.dep = dep
        self._dirs: dict[str, Path | None] = {}  # version → its engine dir, as served
        self._previous: dict[str, str] = {}
        self._last: str | None = None

    def tracks(self) -> dict:
        served, now = scrape_served(self.dep)
        v = served.version
        if v is not None and v not in self._dirs:
            self._dirs[v] = served.draft_dir
            if self._last is not None and self._last != v:
                self._previous[v] = self._last
        self._last = v if v is not None else self._last
        return {self.KEY: Track(v, served.own(now), self._previous.get(v) if v is not None else None)}

    def reload(self, key, version: str) -> bool:
        self.dep.reload()
        return True

    def install(self, key, version: str) -> None:
        if self._dirs.get(version) is None:
            raise LookupError(f"draft {version}'s engine files are unknown here (never served by this server)")
        self.dep.install(self._dirs[version], version)


def server_guard(dep, rollback: Rollback | None = None, hold=None, min_drafts: int = 100, confirm: int = CONFIRM,
                 reference_windows: int = REFERENCE_WINDOWS, trial_pairs: int = 3) -> LiveGuard:
    """The live guard behind an engine server (`serve.guard.LiveGuard` over `ServerSource`), its
    evidence a switchback trial (`serve.switchback.Switchback`, the watcher held by `hold`, a
    `serve.admin.DraftPin`). Raises ValueError as both do."""
    source = ServerSource(dep)
    return LiveGuard(source, Switchback(source, hold, min_drafts, trial_pairs), rollback, min_drafts, confirm,
                     reference_windows)


ReplicaState = Callable[[], dict[str, float]]  # this round's `registry.REPLICA_STATE` values of a replica


def replica_state(requests: Callable[[], float], backlog: Callable[[], int | None] | None = None,
                  last_seal: Callable[[], float | None] | None = None) -> ReplicaState:
    """What a replica logs beside its counters each round (`registry.REPLICA_STATE`): `requests`, the
    server's requests served so far (`requests()`); `capture_backlog`, tokens captured not yet sealed
    (`backlog()`: a capture writer's unsealed tokens, a text log's `serve.textlog.TextLog.backlog_tokens`);
    `last_seal`, its newest seal, s since the epoch (`last_seal()`: `capture.snapshots.last_sealed`).
    Each of the last two only when given and known (not None)."""
    def state() -> dict[str, float]:
        out = {"requests": requests(), "capture_backlog": backlog() if backlog else None,
               "last_seal": last_seal() if last_seal else None}
        return {k: float(v) for k, v in out.items() if v is not None}
    return state


def report_replica(source: GuardSource, tracking_uri: str, target_id: str, replica_id: str,
                   state: ReplicaState | None = None) -> dict:
    """Log this replica's cumulative counters of each registry version it serves (`source`'s tracks —
    the guard's view of an engine server or of the embedded engine — summed over a version's tracks)
    to that version's run under `replica_id`, with its `state()` this round (`replica_state`; None:
    counters only) in the same batch (`registry.log_replica_counters`). Returns {version: counters
    logged}. Raises MlflowException on server errors."""
    per: dict = {}
    for track in source.tracks().values():
        if track.version is not None and track.counters is not None:
            per[track.version] = per[track.version] + track.counters if track.version in per else track.counters
    now = state() if state is not None and per else None
    for version, counters in per.items():
        registry.log_replica_counters(tracking_uri, target_id, version, replica_id, counters, state=now)
    return per


class LiveReporter:
    """Every `every_s` seconds on a daemon thread: `report_live` (`dep`: an engine server's deployment;
    None: none), this replica's counters and `state` (`report_replica` over `source` as `replica_id`;
    None: none), then `guard.check()` (a `LiveGuard`, or None); errors are logged, never raised."""

    def __init__(self, dep, tracking_uri: str, target_id: str, every_s: float = 60.0,
                 tune: Tune | None = None, guard: LiveGuard | None = None, source: GuardSource | None = None,
                 replica_id: str | None = None, state: ReplicaState | None = None):
        self.every_s, self.guard, self.steps = every_s, guard, []
        if dep is not None:
            self.steps.append(("live spec-decode figures not logged",
                               lambda: report_live(dep, tracking_uri, target_id, tune)))
        if source is not None and replica_id:
            self.steps.append(("replica counters not logged",
                               lambda: report_replica(source, tracking_uri, target_id, replica_id, state)))
        if guard is not None:
            self.steps.append(("live guard round skipped", guard.check))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tidespec-live-acceptance", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            for what, step in self.steps:
                try:  # each on its own: a registry outage must not stop the guard's reloads and trials
                    step()
                except TidespecError as e:  # a server stopping (a swap, shutdown) between reading its URL and scraping
                    log.warning("%s this time: %s", what, e)
                except Exception:  # a registry hiccup must not stop serving
                    log.exception("%s this time", what)

    def close(self) -> None:
        """Stop reporting (waits at most 5 s for a report in progress)."""
        self._stop.set()
        self._thread.join(5)
