"""The fleet's snapshot index on the DVC remote: where every replica's seals can be listed without
its git repo (no shared filesystem, no git push between machines; docs/fleet.md).

Beside DVC's own objects (`<remote>/files/md5/...`), one small JSON object per published snapshot:
`<remote>/tidespec/snapshots/<target_id>/<snapshot_id>.json`, the manifest (`manifest_of`: the
snapshot's `snapshot.json` figures, `replica_id`, `sealed` (its UTC seal time), `snapshot_rev`,
and `dvc`, the text of its `.dvc` file, from which any machine rebuilds the pointer and `dvc
pull`s the data: `restore_pointer`); and one per target, `<remote>/tidespec/cycles/<target_id>.json`,
`{"through": <the newest snapshot id the last completed cycle curated>, "at": <UTC time>}`
(`mark_cycle`), from which a replica counts the fleet's tokens since the last cycle
(`tokens_since_cycle`). Snapshot ids sort by seal time (`capture.snapshots.new_snapshot_id`), so
"newer" is "sorts after". Other objects of tidespec's own go under the same folder through
`RemoteIndex.write_doc` / `read_doc` (the deployments a fleet worker pulls: `adapters.fleet_deploy`).

The objects go through DVC's own filesystem for the repo's default remote (`dvc.repo.Repo(repo)
.cloud.get_remote()`): a local directory or S3 (endpoint, credentials and server-side encryption
as `versioning.ensure_repo` configured the remote) alike. DVC is imported inside `RemoteIndex`.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

from ..capture.snapshots import list_snapshots
from ..capture.store import parse_ts, utc_now
from ..workspace import private_dir
from .versioning import VersioningError

log = logging.getLogger(__name__)
PREFIX = "tidespec"  # the remote's folder for tidespec's own objects, beside DVC's files/


class RemoteIndex:
    """Reads, writes and lists the snapshot manifests and cycle marks on `repo`'s default DVC
    remote (`repo`: a git + DVC repo, `versioning.ensure_repo`; any machine of the fleet with the
    same remote), or on a remote named by its URL (`at`). Raises VersioningError when the repo names
    no remote; the remote's own errors (unreachable, denied) propagate from DVC's filesystem."""

    def __init__(self, repo: Path):
        from dvc.exceptions import DvcException
        from dvc.repo import Repo
        try:
            with Repo(str(repo)) as r:
                remote = r.cloud.get_remote()
        except DvcException as e:
            raise VersioningError(["dvc", "remote", "default"], str(e),
                                  "configure a default remote: versioning.ensure_repo(repo, remote_url)") from e
        self.fs, self.root = remote.fs, remote.path

    @classmethod
    def at(cls, url: str, endpoint_url: str | None = None, sse: str | None = "AES256") -> RemoteIndex:
        """The index on the remote `url` itself, with no repo (the machine that deploys a fleet's
        worker): an absolute local directory, or `s3://bucket/prefix` with `endpoint_url` (a moto
        server, MinIO...) and server-side encryption `sse`, as `versioning.ensure_repo` configures a
        repo's remote. Raises ValueError for a relative local path (each machine would read it
        against its own directory)."""
        from dvc.fs import get_cloud_fs
        if "://" not in url and not Path(url).is_absolute():
            raise ValueError(f"remote {url!r}: give an s3:// URL or an absolute path every machine reaches")
        opts = {"endpointurl": endpoint_url, "sse": sse} if url.startswith("s3://") else {}
        fs_cls, conf, root = get_cloud_fs({}, url=url, **{k: v for k, v in opts.items() if v})
        index = cls.__new__(cls)
        index.fs, index.root = fs_cls(**conf), root
        return index

    def _path(self, *parts: str) -> str:
        return self.fs.join(self.root, PREFIX, *parts)

    def write_doc(self, doc: dict, *parts: str) -> str:
        """Store `doc` as JSON at `<remote>/tidespec/<parts...>` (replacing it); returns its path."""
        path = self._path(*parts)
        self.fs.makedirs(self.fs.parent(path), exist_ok=True)  # a local remote's folders; S3 has none
        self.fs.pipe_file(path, json.dumps(doc, indent=1).encode())
        return path

    def read_doc(self, *parts: str) -> dict | None:
        """The JSON object at `<remote>/tidespec/<parts...>` (None: not there)."""
        try:
            return json.loads(self.fs.cat_file(self._path(*parts)))
        except FileNotFoundError:
            return None

    def write(self, manifest: dict) -> str:
        """Store a snapshot's manifest (`manifest_of`); returns its path on the remote."""
        return self.write_doc(manifest, "snapshots", manifest["target_id"], f"{manifest['snapshot_id']}.json")

    def ids(self, target_id: str) -> list[str]:
        """The snapshot ids of `target_id` with a manifest on the remote, oldest first (one listing)."""
        try:  # listed afresh each time: s3fs keeps a listing cache, and manifests come from other machines
            names = self.fs.ls(self._path("snapshots", target_id), detail=False, refresh=True)
        except FileNotFoundError:
            return []
        return sorted(Path(n).name[: -len(".json")] for n in names if n.endswith(".json"))

    def read(self, target_id: str, snapshot_id: str) -> dict | None:
        """A snapshot's manifest (None: not on the remote)."""
        return self.read_doc("snapshots", target_id, f"{snapshot_id}.json")

    def manifests(self, target_id: str, after: str = "") -> list[dict]:
        """The manifests of `target_id` whose ids sort after `after` ("": all), oldest first (by seal
        time): one listing, then one read per manifest."""
        return [m for sid in self.ids(target_id) if sid > after and (m := self.read(target_id, sid))]

    def cycle_mark(self, target_id: str) -> dict | None:
        """The last completed cycle's mark for `target_id` (`mark_cycle`), None before the first."""
        return self.read_doc("cycles", f"{target_id}.json")

    def mark_cycle(self, target_id: str, through: str) -> dict:
        """Record that a cycle curated the fleet's snapshots up to `through` (a snapshot id)."""
        mark = {"target_id": target_id, "through": through, "at": utc_now()}
        self.write_doc(mark, "cycles", f"{target_id}.json")
        return mark


def manifest_of(snapshot: Path) -> dict:
    """The manifest of a sealed, DVC-tracked snapshot directory: its `snapshot.json`, plus
    `replica_id` (None: sealed before fleets), `sealed` (its seal time, UTC ISO 8601), `snapshot_rev`
    (the `.dvc` file's content md5) and `dvc` (that file's text). Raises FileNotFoundError without
    `snapshot.json` or `<snapshot>.dvc`."""
    import yaml
    snapshot = Path(snapshot)
    info = json.loads((snapshot / "snapshot.json").read_text())
    dvc_text = snapshot.with_name(snapshot.name + ".dvc").read_text()
    return info | {"replica_id": info.get("replica_id"), "sealed": info.get("created"),
                   "snapshot_rev": str(yaml.safe_load(dvc_text)["outs"][0]["md5"]), "dvc": dvc_text}


def publish_manifests(index: RemoteIndex, snapshots_root: Path, target_id: str) -> dict[str, dict]:
    """Write the manifest of every local, DVC-tracked snapshot of `target_id` that the remote lacks
    (the one just pushed, and any whose earlier publish failed after its push). Call it after
    `dvc push`: a manifest names data the remote holds. Returns {snapshot id: manifest written}."""
    have = set(index.ids(target_id))
    out = {}
    for snap in list_snapshots(snapshots_root, target_id):
        if snap.name not in have and snap.with_name(snap.name + ".dvc").exists():
            out[snap.name] = manifest_of(snap)
            index.write(out[snap.name])
    return out


def list_remote_snapshots(repo: Path, target_id: str, after: str = "") -> list[dict]:
    """The manifests of every replica's snapshots of `target_id` on `repo`'s DVC remote whose ids sort
    after `after` ("": all), oldest first (by seal time; `RemoteIndex.manifests`). Raises as
    `RemoteIndex`."""
    return RemoteIndex(repo).manifests(target_id, after)


def last_seals(repo: Path, target_id: str) -> dict[str, float]:
    """{replica id: when it sealed its newest snapshot of `target_id`, s since the epoch} from the
    manifests on `repo`'s DVC remote (`tidespec fleet status`); snapshots sealed before replica ids are left
    out. Raises as `RemoteIndex`."""
    out: dict[str, float] = {}
    for m in list_remote_snapshots(repo, target_id):
        if m.get("replica_id") and m.get("sealed"):
            out[m["replica_id"]] = max(out.get(m["replica_id"], 0.0), parse_ts(m["sealed"]))
    return out


def tokens_since_cycle(index: RemoteIndex, target_id: str) -> tuple[int, int]:
    """(tokens, snapshots) sealed across the fleet after the last completed cycle's mark (all of them
    before the first cycle): the fleet threshold's count (`capture.fleet_min_tokens`). A snapshot
    published late with an id older than the mark is not counted (its cycle has passed it)."""
    mark = index.cycle_mark(target_id) or {}
    got = index.manifests(target_id, mark.get("through", ""))
    return sum(int(m.get("num_tokens", 0)) for m in got), len(got)


def restore_pointer(manifest: dict, snapshots_root: Path) -> Path:
    """Write `<snapshots_root>/<target_id>/<snapshot_id>.dvc` from a manifest (kept when present), so
    `dvc pull` fetches the snapshot and the cycle's lineage reads its rev. Returns the pointer."""
    d = Path(snapshots_root) / manifest["target_id"]
    ptr = d / f"{manifest['snapshot_id']}.dvc"
    if not ptr.exists():
        private_dir(d)  # as a sealed snapshot's folder: it will hold the pulled records
        ptr.write_text(manifest["dvc"])
    return ptr
