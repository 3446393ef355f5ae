"""The seal publisher: what happens after a seal (on the writer's publisher thread, never the serving
path): `dvc add` + `dvc push` the snapshot (+ git commit of its `.dvc` file: `versioning`), its
manifest on the DVC remote beside the data (`remote_snapshots`: where every machine of a fleet lists
it), retention, drift (`curate.snapshot_drift`), the Prefect event (`orchestrate.capture_threshold`).

A snapshot whose publish failed (remote down...) stays local; the next publish tracks and
pushes it too, and retention drops a snapshot only after pushing it.

Retention: the newest `capture.keep_local_snapshots` sealed snapshots stay on local disk; older
ones are pushed (idempotent) then dropped locally with their cache objects (`dvc pull
<sid>.dvc` restores one). A snapshot that is not on the remote is never dropped.

Trigger: `tidespec.capture.threshold` is emitted when the snapshot was sealed on the token
threshold (in a fleet, `capture.fleet_min_tokens`: when the tokens every replica sealed since the
last cycle reach it, counted from the remote's manifests: `remote_snapshots.tokens_since_cycle`), or
its token distribution drifted from the last curated set by more than `curate.drift_threshold` bits
(JSD). The event carries the snapshot's manifest.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..capture.curate import snapshot_drift
from ..capture.snapshots import SnapshotInfo, list_snapshots
from . import orchestrate, remote_snapshots, versioning

log = logging.getLogger(__name__)


def apply_retention(repo: Path, snapshots_root: Path, target_id: str, keep: int) -> list[str]:
    """Drop local copies of all but the newest `keep` snapshots of `target_id` (DVC-tracked ones
    only, after making sure the remote has them). Returns the dropped snapshot ids.
    Raises VersioningError when the push fails (nothing is dropped then)."""
    snaps = list_snapshots(snapshots_root, target_id)
    old, kept = snaps[:-keep], snaps[-keep:]
    kept = [s for s in kept if s.with_name(s.name + ".dvc").exists()]
    dropped = []
    for s in old:
        dvcfile = s.with_name(s.name + ".dvc")
        if not dvcfile.exists():
            log.warning("retention: %s is not DVC-tracked, kept locally", s)
            continue
        versioning.push(repo, [dvcfile])
        versioning.drop_local(repo, s, keep=kept)
        dropped.append(s.name)
    return dropped


@dataclass
class Publisher:
    """`on_seal` callback of a CaptureWriter. `repo`: the git+DVC repo holding the snapshots (set
    up with versioning.ensure_repo); `curated`: the last curated index (drift reference);
    `commit`: git-commit the `.dvc` files (off in a user's checkout: the demo); `fleet_min_tokens`:
    the fleet threshold (`capture.fleet_min_tokens`; None: the seal's own reason). Each call's
    result is appended to `published`."""

    repo: Path
    snapshots_root: Path
    keep_local: int = 8
    curated: Path | None = None
    drift_threshold: float = 0.3
    commit: bool = True
    emit: bool = True
    fleet_min_tokens: int | None = None
    published: list = field(default_factory=list)

    @classmethod
    def for_workspace(cls, ws, params, commit: bool = False) -> Publisher:
        """The publisher of a workspace's seals as params.yaml says (capture.keep_local_snapshots,
        curate.drift_threshold against the last curated set): what serve, ingest and `snapshots
        seal` use. `ws`: a `workspace.Workspace` whose root is the git+DVC repo."""
        return cls(ws.root, ws.snapshots, params.capture.keep_local_snapshots, ws.curated,
                   params.curate.drift_threshold, commit=commit, fleet_min_tokens=params.capture.fleet_min_tokens)

    def pending(self, target_id: str) -> list[Path]:
        """Local snapshots of `target_id` a publish never reached (no `.dvc` pointer: the process was
        killed between a seal and its `dvc add`), oldest first; local reads only. A serving process hands
        the newest to its writer at start (`CaptureWriter(unpublished=)`): its publish takes the older
        ones along. One killed later, during its push, has its pointer: the next publish pushes every
        tracked snapshot and writes the manifests the remote lacks."""
        return [s for s in list_snapshots(self.snapshots_root, target_id)
                if not s.with_name(s.name + ".dvc").exists()]

    def __call__(self, info: SnapshotInfo) -> dict:
        """Publish one sealed snapshot. Returns {snapshot_id, snapshot_rev, git_commit,
        dropped_local, also_published, manifest (its object on the remote), fleet_tokens (tokens
        sealed across the fleet since the last cycle | None without a fleet threshold), drift_jsd
        (bits | None), trigger ("tokens" | "drift" | None), event_id}. Raises VersioningError
        (dvc/git failed: the snapshot stays local, the next call retries it), the remote's own
        errors while writing the manifest (retried the same way)."""
        # this snapshot, and any earlier one whose publish failed (still untracked)
        todo = [s for s in list_snapshots(self.snapshots_root, info.target_id)  # older only: newer ones have
                if s.name < info.path.name and not s.with_name(s.name + ".dvc").exists()] + [info.path]  # their own
        for s in todo:
            rev = versioning.track(self.repo, s)
        # push every local tracked snapshot: one whose earlier push failed goes now (a no-op for the rest)
        versioning.push(self.repo, [s.with_name(s.name + ".dvc") for s in list_snapshots(self.snapshots_root,
                                    info.target_id) if s.with_name(s.name + ".dvc").exists()])
        index = remote_snapshots.RemoteIndex(self.repo)  # after the push: a manifest names data the remote holds
        manifest = remote_snapshots.publish_manifests(index, self.snapshots_root, info.target_id).get(
            info.snapshot_id) or remote_snapshots.manifest_of(info.path)
        sha = versioning.commit_git(self.repo, f"snapshot {info.snapshot_id}: {info.num_records} records, "
                                               f"{info.num_tokens} tokens ({info.reason})") if self.commit else None
        dropped = apply_retention(self.repo, self.snapshots_root, info.target_id, self.keep_local)
        drift = snapshot_drift(info.path, self.curated) if self.curated else None
        fleet = remote_snapshots.tokens_since_cycle(index, info.target_id)[0] if self.fleet_min_tokens else None
        sealed_enough = fleet >= self.fleet_min_tokens if fleet is not None else info.reason == "tokens"
        trigger = "tokens" if sealed_enough else (
            "drift" if drift is not None and drift >= self.drift_threshold else None)
        out = {"snapshot_id": info.snapshot_id, "snapshot_rev": rev, "git_commit": sha, "dropped_local": dropped,
               "also_published": [s.name for s in todo[:-1]], "manifest": manifest, "fleet_tokens": fleet,
               "drift_jsd": drift, "trigger": trigger, "event_id": None}
        if trigger and self.emit:
            out["event_id"] = orchestrate.capture_threshold(info.snapshot_id, info.target_id, {
                "trigger": trigger, "snapshot_rev": rev, "num_records": info.num_records,
                "num_tokens": info.num_tokens, "bytes_per_token": round(info.bytes_per_token, 1),
                "drift_jsd": drift, "workloads": info.workloads, "replica_id": info.replica_id,
                "fleet_tokens": fleet, "manifest": manifest})
        log.info("published %s", json.dumps(out))
        self.published.append(out)
        return out
