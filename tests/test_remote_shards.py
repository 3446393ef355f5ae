"""Training from shards the workspace does not hold: each one fetched from the DVC remote (a local
directory, and S3 on moto) into a bounded cache while the trainer reads it
(`adapters.versioning.RemoteShards`, `train.shard_cache_mb`), to the weights of a run on the
local snapshot, the cache never above its bound plus one shard."""
from __future__ import annotations

from pathlib import Path

import boto3
import pytest
import torch
from safetensors.torch import load_file

from conftest import make_tiny_workspace
from tidespec.adapters import versioning


def _train(ws, params, out: Path) -> dict:
    from tidespec.steps.cycle import train_candidate
    return train_candidate(ws, params, ws.curated, None, out)


@pytest.mark.parametrize("remote", ["local", "s3"])
def test_train_reads_missing_shards_from_the_remote_within_the_cache_bound(tmp_path, tiny_target_dir, remote,
                                                                           request):
    from tidespec.capture.snapshots import list_snapshots
    from tidespec.steps.cycle import step_curate
    from tidespec.steps.train_data import remote_shards
    (tmp_path / "ws").mkdir()
    ws, params, target = make_tiny_workspace(tmp_path / "ws", tiny_target_dir, n_requests=16)
    if remote == "s3":
        endpoint = request.getfixturevalue("aws_env")
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="tidespec-shards")
        versioning.ensure_repo(ws.root, "s3://tidespec-shards/dvc", remote_name="s3", endpoint_url=endpoint,
                               cache_type="hardlink,copy")
    else:
        versioning.ensure_repo(ws.root, str(tmp_path / "remote"), machine_local=True)
    snap = list_snapshots(ws.snapshots, target.target_id)[0]
    versioning.track(ws.root, snap)
    versioning.push(ws.root)
    step_curate(ws, params, target.target_id)
    shard_bytes = max(f.stat().st_size for f in snap.glob("*.safetensors"))
    n_shards = len(list(snap.glob("*.safetensors")))
    assert n_shards >= 4
    m_here = _train(ws, params, tmp_path / "here")

    versioning.drop_local(ws.root, snap)  # the workspace copy and the local DVC cache: only the remote has it
    assert not snap.exists()
    bound_mb = 1.5 * shard_bytes / 2**20  # one shard and a half: every epoch fetches them again
    params = params.model_copy(update={"train": params.train.model_copy(update={"shard_cache_mb": bound_mb})})
    shards = remote_shards(params.train, ws.root)
    assert shards is not None and shards.digest(snap / "nope.safetensors") is None
    m_remote = _train(ws, params, tmp_path / "remote-run")
    a, b = load_file(str(tmp_path / "here" / "model.safetensors")), load_file(str(tmp_path / "remote-run" /
                                                                                "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert m_remote["train/loss"] == m_here["train/loss"]
    cache = ws.work / "shard-cache"
    held = [f for f in cache.iterdir() if not f.name.startswith(".")]
    assert 1 <= len(held) and sum(f.stat().st_size for f in held) <= bound_mb * 2**20 + shard_bytes
    assert not snap.exists()  # nothing was pulled into the workspace

    with pytest.raises(FileNotFoundError, match="snapshots pull"):
        shards.locate(ws.snapshots / "missing" / "shard-x.safetensors")
