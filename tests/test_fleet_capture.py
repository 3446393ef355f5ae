"""Capture from every replica of a fleet (docs/fleet.md, Capture across replicas): two replicas
(separate roots and git repos, one DVC remote) seal and publish; a third root, the worker, lists
their snapshots from the remote's manifests and curates the newest across replicas without their
repos; the threshold fires on the fleet's tokens since the last cycle. Real DVC, a local remote and
a moto S3 remote."""
import json
import os
import time
from pathlib import Path

import boto3
import pytest
import torch

from tidespec.adapters import versioning
from tidespec.adapters.publish import Publisher
from tidespec.adapters.remote_snapshots import RemoteIndex, list_remote_snapshots
from tidespec.capture.snapshots import list_snapshots, new_snapshot_id, seal
from tidespec.capture.writer import CaptureWriter
from tidespec.config import CaptureParams, CurateParams, Params
from tidespec.steps import cycle
from tidespec.workspace import Workspace

TID = "tid"
T = 12  # tokens per record


def _rec(i):
    g = torch.Generator().manual_seed(i)
    m = torch.zeros(T, dtype=torch.uint8)
    m[4:] = 1
    return {"input_ids": torch.randint(0, 100, (T,), generator=g, dtype=torch.int32), "loss_mask": m,
            "aux_hidden_states": torch.randn(T, 24, generator=g), "hidden_states": torch.randn(T, 8, generator=g)}


def _seal(root, replica_id, first, n=3):
    """Capture records first..first+n-1 in `root` and seal them as replica `replica_id`."""
    w = CaptureWriter(root / "data" / "capture", TID, CaptureParams(shard_max_records=4))
    for i in range(first, first + n):
        w.submit(_rec(i), request_id=f"{replica_id}-{i}", workload="code", acceptance_length=1.0)
    w.close()
    return seal(root / "data" / "capture", root / "data" / "snapshots", TID, replica_id=replica_id)


def _params(fleet: bool, **curate) -> Params:
    return Params(curate=CurateParams(fleet=fleet, holdout_fraction=0.0, val_fraction=0.0, **curate),
                  capture=CaptureParams(fleet_min_tokens=60 if fleet else None))


def test_snapshot_ids_carry_the_replica_and_sort_by_seal_time():
    old = new_snapshot_id()
    time.sleep(0.001)
    new = [new_snapshot_id("eu-1.a_b"), new_snapshot_id("us-2")]
    assert "-eu-1.a_b-" in new[0] and "-us-2-" in new[1] and old.count("-") == 1
    assert sorted([new[1], old, new[0]]) == [old, *new]  # old ids first: they are older
    with pytest.raises(ValueError, match="curate.fleet"):
        Params(capture=CaptureParams(fleet_min_tokens=10))


def test_two_replicas_one_worker_local_remote(tmp_path):
    remote = str(tmp_path / "remote")
    roots = {r: tmp_path / r for r in ("a", "b", "worker")}
    for root in roots.values():  # separate git + DVC repos sharing nothing but the remote
        versioning.ensure_repo(root, remote)
    pubs = {r: Publisher(roots[r], roots[r] / "data" / "snapshots", emit=False, fleet_min_tokens=60)
            for r in ("a", "b")}
    out = [pubs["a"](_seal(roots["a"], "a", 0)), pubs["b"](_seal(roots["b"], "b", 10)),
           pubs["a"](_seal(roots["a"], "a", 20))]
    ids = [o["snapshot_id"] for o in out]
    assert [i.split("-")[1] for i in ids] == ["a", "b", "a"] and ids == sorted(ids) and len(set(ids)) == 3
    # the threshold counts the fleet: 36 tokens alone are below 60; with the other replica's 36, above
    assert [(o["fleet_tokens"], o["trigger"]) for o in out] == [(36, None), (72, "tokens"), (108, "tokens")]
    assert all(o["git_commit"] for o in out)  # each replica's own repo

    # the worker lists every replica's snapshots from the remote, with no replica's repo
    listed = list_remote_snapshots(roots["worker"], TID)
    assert [m["snapshot_id"] for m in listed] == ids and [m["replica_id"] for m in listed] == ["a", "b", "a"]
    assert [m["sealed"] for m in listed] == sorted(m["sealed"] for m in listed)
    assert [m["num_tokens"] for m in listed] == [36] * 3 and listed[1] == out[1]["manifest"]
    ws = Workspace(roots["worker"])

    # a single checkout (curate.fleet false) never looks at the remote: nothing here, as before
    single = _params(False, window=2)
    assert "no sealed snapshots" in cycle.nothing_new(ws, TID, single)
    assert cycle.pull_window(ws, single, TID) == [] and not ws.snapshots.exists()

    fleet = _params(True, window=2)
    assert cycle.nothing_new(ws, TID, fleet) is None
    cur = cycle.step_curate(ws, fleet, TID)  # the window: the newest 2 across replicas, by seal time
    assert cur["pulled"] == ids[1:] and cur["num_train"] == 6
    idx = json.loads(ws.curated.read_text())
    assert sorted(e["request_id"] for e in idx["train"]) == ["a-20", "a-21", "a-22", "b-10", "b-11", "b-12"]
    revs = json.loads(cycle.lineage(ws.curated)["snapshot_revs"])  # the rebuilt pointers give the lineage
    assert revs == {o["snapshot_id"]: o["snapshot_rev"] for o in out[1:]}

    cycle.mark_done(ws, ws.curated, fleet)  # the fleet's count starts again after the newest curated
    assert RemoteIndex(roots["worker"]).cycle_mark(TID)["through"] == ids[2]
    nxt = pubs["b"](_seal(roots["b"], "b", 30))
    assert (nxt["fleet_tokens"], nxt["trigger"]) == (36, None)


@pytest.mark.services
def test_a_replica_and_a_worker_on_s3(tmp_path, aws_env):
    boto3.client("s3", endpoint_url=aws_env).create_bucket(Bucket="fleet")
    roots = {r: tmp_path / r for r in ("replica", "worker")}
    for root in roots.values():
        versioning.ensure_repo(root, "s3://fleet/dvc", remote_name="s3", endpoint_url=aws_env)
    pub = Publisher(roots["replica"], roots["replica"] / "data" / "snapshots", emit=False, commit=False)
    sid = pub(_seal(roots["replica"], "gpu-7-8000", 0))["snapshot_id"]
    s3 = boto3.client("s3", endpoint_url=aws_env)
    key = f"dvc/tidespec/snapshots/{TID}/{sid}.json"
    assert s3.head_object(Bucket="fleet", Key=key)["ServerSideEncryption"] == "AES256"  # as the data
    ws = Workspace(roots["worker"])
    assert [m["snapshot_id"] for m in list_remote_snapshots(ws.root, TID)] == [sid]
    cur = cycle.step_curate(ws, _params(True, window=1), TID)
    assert cur["pulled"] == [sid] and cur["num_train"] == 3


KILLED_REPLICA = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from test_fleet_capture import _rec
from tidespec.capture.writer import CaptureWriter
from tidespec.config import CaptureParams
from tidespec.workspace import Workspace
ws = Workspace(Path({root!r}))
def publishing(info):  # the publish under way when the process is killed
    print("SEALED", info.snapshot_id, flush=True)
    time.sleep(3600)
w = CaptureWriter(ws.capture_dir({tid!r}), {tid!r}, CaptureParams(shard_max_records=2, seal_min_tokens=6 * {T}),
                  snapshots_root=ws.snapshots, on_seal=publishing, replica_id="r1", idle_flush_s=0.1)
for i in range(6):
    w.submit(_rec(i), request_id=f"r1-{{i}}", workload="code", acceptance_length=1.0)
time.sleep(3600)
"""


def test_a_replica_killed_between_its_seal_and_its_publish_publishes_it_once_restarted(tmp_path, tiny_target_dir):
    """SIGKILL while a seal's publish is under way (a replica process whose publish blocks): every record is in
    the sealed snapshot and the remote has nothing of it; `tidespec serve` restarted on the root publishes it
    at start (its DVC pointer, one manifest on the remote: what a fleet's worker lists), and a second restart
    publishes nothing again."""
    import select
    import signal
    import subprocess
    import sys

    from conftest import health, serving, tiny_params_yaml, wait_until
    from tidespec.capture.store import read_manifest
    from tidespec.config import load_params
    from tidespec.models.load import get_target
    root = tmp_path / "replica"
    root.mkdir()
    (root / "params.yaml").write_text(tiny_params_yaml(tiny_target_dir))
    tid = get_target(load_params(root / "params.yaml"))[0].target_id
    versioning.ensure_repo(root, str(tmp_path / "remote"))
    script = KILLED_REPLICA.format(tests=str(Path(__file__).parent), root=str(root), tid=tid, T=T)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert select.select([child.stdout], [], [], 120)[0], "the replica never sealed"
        line = child.stdout.readline()
        assert line.startswith("SEALED "), line
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    ws, sid = Workspace(root), line.split()[1]
    (snap,) = list_snapshots(ws.snapshots, tid)
    assert snap.name == sid and not snap.with_name(sid + ".dvc").exists()
    assert sorted(r.request_id for r in read_manifest(snap)) == [f"r1-{i}" for i in range(6)]
    index = RemoteIndex(root)
    assert index.ids(tid) == []
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    with serving(root, tmp_path, env) as (url, proc):
        wait_until(lambda: health(url), 180, "/health", proc)
        wait_until(lambda: index.ids(tid) == [sid], 120, "the killed seal's manifest on the remote", proc)
    assert snap.with_name(sid + ".dvc").exists() and [m["num_records"] for m in index.manifests(tid)] == [6]
    assert (tmp_path / "serve.log").read_text().count(f'published {{"snapshot_id": "{sid}"') == 1  # once
    with serving(root, tmp_path, env) as (url, proc):  # nothing left to publish: nothing published twice
        wait_until(lambda: health(url), 180, "/health", proc)
    assert index.ids(tid) == [sid] and "published" not in (tmp_path / "serve.log").read_text()


def test_a_seal_finished_at_start_is_published_once_and_the_newest_unpublished_otherwise(tmp_path, monkeypatch):
    """The writer's start publishes what recovery finished, else the newest of `unpublished` (its publish takes
    older ones along), never one snapshot twice: a seal interrupted after its rename is both recovered and
    listed as unpublished (no pointer), and is published once."""
    from tidespec.capture import snapshots
    from tidespec.capture.snapshots import load_snapshot
    cap, snaps = tmp_path / "cap", tmp_path / "snaps"
    a = _seal(tmp_path, "r1", 0)  # sealed in tmp_path/data: another replica root's layout
    w = CaptureWriter(cap, TID, CaptureParams(shard_max_records=4))
    for i in range(3):
        w.submit(_rec(i), request_id=f"r2-{i}", workload="code", acceptance_length=1.0)
    w.close()
    monkeypatch.setattr(snapshots.Path, "unlink", lambda self, missing_ok=False: (_ for _ in ()).throw(OSError()))
    with pytest.raises(OSError):
        seal(cap, snaps, TID, replica_id="r2")  # renamed into place, its capture files not yet removed
    monkeypatch.undo()
    (b,) = list_snapshots(snaps, TID)
    published = []
    CaptureWriter(cap, TID, snapshots_root=snaps, on_seal=published.append,
                  unpublished=[load_snapshot(b)]).close()
    assert [i.snapshot_id for i in published] == [b.name]  # recovered, not published a second time
    published.clear()
    older = load_snapshot(tmp_path / "data" / "snapshots" / TID / a.snapshot_id)
    CaptureWriter(tmp_path / "cap2", TID, snapshots_root=snaps, on_seal=published.append,
                  unpublished=[older, load_snapshot(b)]).close()
    assert [i.snapshot_id for i in published] == [b.name]  # the newest only
