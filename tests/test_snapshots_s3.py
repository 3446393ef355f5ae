"""Snapshots on a DVC S3 remote (moto server on 127.0.0.1): publish (dvc add + push + git commit),
server-side encryption, retention, the Prefect event, `dvc pull` of an older snapshot on a fresh clone
(`dvc repro` reproducing an older cycle's metrics there: tests/test_repro_s3.py)."""
import json
import time
import urllib.request
from pathlib import Path

import boto3
import pytest
import torch

from tidespec.adapters import versioning
from tidespec.adapters.publish import Publisher
from tidespec.capture.snapshots import list_snapshots
from tidespec.capture.writer import CaptureWriter
from tidespec.config import CaptureParams

pytestmark = pytest.mark.services
ROOT = Path(__file__).resolve().parents[1]
TID = "tid"


def _bucket(endpoint: str, name: str) -> str:
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _events(prefect_url: str, name: str) -> list[dict]:
    body = json.dumps({"filter": {"event": {"name": [name]}, "occurred": {"since": "2000-01-01T00:00:00Z"}},
                       "limit": 50}).encode()
    req = urllib.request.Request(f"{prefect_url}/events/filter", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["events"]


def _rec(i, T=12, H=8):
    g = torch.Generator().manual_seed(i)
    m = torch.zeros(T, dtype=torch.uint8)
    m[4:] = 1
    return {"input_ids": torch.randint(0, 100, (T,), generator=g, dtype=torch.int32), "loss_mask": m,
            "aux_hidden_states": torch.randn(T, 3 * H, generator=g), "hidden_states": torch.randn(T, H, generator=g)}


def test_publish_s3_sse_retention_event_and_fresh_clone_pull(tmp_path, aws_env, prefect_server, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", prefect_server)
    bucket = _bucket(aws_env, "tidespec-snapshots")
    repo = tmp_path / "repo"
    versioning.ensure_repo(repo, f"s3://{bucket}/dvc", remote_name="s3", endpoint_url=aws_env,
                           cache_type="hardlink,copy")
    snaps = repo / "data" / "snapshots"
    pub = Publisher(repo, snaps, keep_local=2)
    w = CaptureWriter(
        repo / "data" / "capture",
        TID,
        CaptureParams(shard_max_records=2, compression="zstd", seal_min_tokens=48),
        snapshots_root=snaps,
        on_seal=pub,
    )
    for i in range(12):  # 3 snapshots of 4 × 12 tokens, sealed on the token threshold
        w.submit(_rec(i), request_id=f"r{i}", workload="code", acceptance_length=1.0)
        if i % 4 == 3:
            w.flush()
    w.close()  # waits for the publisher
    assert w.stats().publish_errors == 0 and len(pub.published) == 3
    sids = [p["snapshot_id"] for p in pub.published]
    assert [p["trigger"] for p in pub.published] == ["tokens"] * 3
    # retention: the oldest lives only on the remote (its .dvc file stays, so it can be pulled)
    local = [p.name for p in list_snapshots(snaps, TID)]
    assert local == sids[1:] and sum((p["dropped_local"] for p in pub.published), []) == [sids[0]]
    assert (snaps / TID / f"{sids[0]}.dvc").exists() and not (snaps / TID / sids[0]).exists()
    cache = repo / ".dvc" / "cache"
    assert oct(cache.stat().st_mode & 0o777) == "0o700"
    # S3: every object server-side encrypted
    s3 = boto3.client("s3", endpoint_url=aws_env)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=bucket)["Contents"]]
    assert len(keys) >= 3 * 4  # per snapshot: ≥2 shards + manifest + snapshot.json (+ .dir)
    assert {s3.head_object(Bucket=bucket, Key=k).get("ServerSideEncryption") for k in keys} == {"AES256"}
    # one git commit per snapshot, holding only DVC metadata
    log = versioning.git(repo, "log", "--format=%s").stdout.splitlines()
    assert sum(line.startswith("snapshot ") for line in log) == 3
    # the Prefect server received tidespec.capture.threshold for each snapshot
    want = {f"tidespec.snapshot.{p['snapshot_id']}" for p in pub.published}
    deadline = time.monotonic() + 60  # the server persists events asynchronously (~2 s)
    while True:
        got = {e["resource"]["prefect.resource.id"]: e["payload"]
               for e in _events(prefect_server, "tidespec.capture.threshold")}
        if want <= set(got) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert all(p["event_id"] for p in pub.published)
    for p in pub.published:
        pl = got[f"tidespec.snapshot.{p['snapshot_id']}"]
        assert pl["trigger"] == "tokens" and pl["num_tokens"] == 48 and pl["snapshot_rev"] == p["snapshot_rev"]
    # a fresh clone pulls the older (remote-only) snapshot bit-exact
    newest = _files(snaps / TID / sids[2])
    clone = tmp_path / "clone"
    versioning.git(tmp_path, "clone", "-q", str(repo), str(clone))
    versioning.pull(clone, [clone / "data" / "snapshots" / TID / f"{sids[0]}.dvc"])
    pulled = clone / "data" / "snapshots" / TID / sids[0]
    man = [json.loads(x)["request_id"] for x in (pulled / "manifest.jsonl").read_text().splitlines()]
    assert man == ["r0", "r1", "r2", "r3"]
    from tidespec.capture.store import read_manifest, read_record
    for row in read_manifest(pulled):
        got_r, want = read_record(pulled, row), _rec(int(row.request_id[1:]))
        assert torch.equal(got_r["hidden_states"], want["hidden_states"].bfloat16())
    versioning.pull(clone, [clone / "data" / "snapshots" / TID / f"{sids[2]}.dvc"])
    assert _files(clone / "data" / "snapshots" / TID / sids[2]) == newest
