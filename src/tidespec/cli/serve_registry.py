"""`tidespec serve`'s wiring to the MLflow registry: where the served champion comes from
(`champion_source`: data/drafts, or the registry followed), the live guard's rollback through the
registry (`registry_rollback`), `/admin/draft {"version"}` (`registry_loader`) and the embedded
engine's live counters logged under the replica's id (`replica_reporter`). Each is None (or the
directory source) without MLFLOW_TRACKING_URI."""
from __future__ import annotations

import logging
import os

from .common import console

log = logging.getLogger("tidespec.cli.serve")


def replica_reporter(p, engine, target_id: str, metrics=None, backlog=None, last_seal=None):
    """With MLFLOW_TRACKING_URI and serve.live_stats_s > 0, the embedded engine's counters per served
    version logged under this replica's id every serve.live_stats_s s (`backends.live.LiveReporter`
    over the guard's `serve.draft_health.EngineSource`: what a canary rollout is decided on), with its
    requests served (`metrics`: the server's `serve.metrics.ServeMetrics`), capture backlog and last
    seal (`backlog()`, `last_seal()`: `backends.live.replica_state`); else None."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri or p.serve.live_stats_s <= 0:
        return None
    from ..backends.live import LiveReporter, replica_state
    from ..serve.draft_health import EngineSource
    state = replica_state(metrics.requests_served, backlog, last_seal) if metrics is not None else None
    return LiveReporter(None, uri, target_id, p.serve.live_stats_s, source=EngineSource(engine),
                        replica_id=p.serve.replica_id, state=state)


def registry_rollback(p, target_id: str, ws, follower=None):
    """The draft-health guards' rollback (`serve.guard.LiveGuard`): when the registry's
    champion is still the version the guard found worse, `registry.rollback` (an audited decision),
    then the served directory follows the registry (`_follow_registry`: the restored champion
    deployed where the champion watcher installs it, even when the registry had moved on: a deploy
    that failed after the registry moved is repaired at the guard's retry); returns the restored
    version (None: nothing rolled back). None without MLFLOW_TRACKING_URI or with
    `serve.auto_rollback` off (the guard then reports only)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri or not p.serve.auto_rollback:
        return None
    from ..adapters import registry

    def roll_back(version: str, reason: str, workload: str = "") -> str | None:
        champ, back = registry.champion(uri, target_id, workload), None
        if champ is not None and champ.version == version:
            back = registry.rollback(uri, target_id, f"automatic (draft health): {reason}", workload=workload).version
        else:
            log.warning("not rolling back v%s: the registry's %s is %s now", version,
                        registry.champion_alias(workload), champ.version if champ else None)
        if champ is not None:
            _follow_registry(uri, target_id, ws, follower, workload)
        return back
    return roll_back


def _follow_registry(uri: str, target_id: str, ws, follower, workload: str) -> None:
    """The served directory of `workload` ("" the generalist) brought to the registry's champion:
    with `serve.champion_source: registry`, a round of the registry `follower` (its directories,
    nothing under data/drafts); else the local deploy into data/drafts/champion or
    data/drafts/classes (`steps.deploy.local`; raises as it does)."""
    if follower is not None:
        follower.check()
        return
    from ..steps.deploy.local import deploy_champion, deploy_class_champions
    if workload:
        deploy_class_champions(uri, target_id, ws.class_champions)
    else:
        deploy_champion(uri, target_id, ws.champion)


FIRST_FOLLOW_S = 30.0  # a start waits at most this long (s) for the registry follower's first round


def champion_source(p, ws, target_id: str, classes: bool = True):
    """(the champion bundle, the class champions' root, the registry follower or None) a server serves from
    (`classes` False: a server with one draft, whose follower leaves the classes' alone), by
    `serve.champion_source` (`workspace.Workspace.served_champions`): `directory` — data/drafts, which
    the cycle's deploy step writes; `registry` — this server's own copies under .tidespec/registry, kept
    by a `registry.RegistryFollower` every `serve.watch_champion_s` s (a `serve.canary` replica's: the `canary`
    alias while one exists, else the champion), after its first round (waited for
    at most FIRST_FOLLOW_S s; a registry that has not answered by then is said, the server starts on
    what the copies hold and the follower keeps trying)."""
    champ, classes_dir = ws.served_champions(p.serve.champion_source)
    if p.serve.champion_source != "registry":
        return champ, classes_dir, None
    from ..adapters import registry
    from ..workspace import served_version
    uri = os.environ["MLFLOW_TRACKING_URI"]  # `serve_preflight` refused the registry source without it
    follower = registry.RegistryFollower(uri, target_id, champ, classes_dir if classes else None,
                                         p.serve.watch_champion_s, canary=p.serve.canary)
    done = follower.first_round(FIRST_FOLLOW_S)
    if done and follower.error is None:
        said = (f"{'canary (else champion)' if p.serve.canary else 'champion'} {served_version(champ) or 'none yet'} "
                f"in {champ.parent}")
    else:
        said = (f"not answering after {FIRST_FOLLOW_S:g} s" if not done else f"failed ({follower.error})") + \
            f", serving what {champ.parent} holds (retried every serve.watch_champion_s)"
    console.print(f"serve: following the registry at {uri}: {said}", markup=False, highlight=False, soft_wrap=True)
    return champ, classes_dir, follower


def registry_loader(target_id: str, ws):
    """`/admin/draft {"version"}` → the registry (needs MLFLOW_TRACKING_URI and the [mlops] extra);
    None without a tracking URI: the server then swaps by path only."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return None
    from ..adapters import registry  # mlflow: only for a server that has a registry

    def load(ref):
        return registry.download_version(uri, target_id, ref, ws.work / "served")
    return load
