"""`dvc repro` on a fresh clone of an older cycle reproduces its metrics, its inputs pulled from a DVC
S3 remote (moto server on 127.0.0.1); `make repro`'s flags run with snapshots retention left on the
remote only (the curate stage pulls those its window needs). Its own file: one of the longest tests
of the suite, scheduled beside the others by the parallel run (`make test`: one file per worker at a
time)."""
import json
import os
import re
import shutil
import sys
from pathlib import Path

import boto3
import pytest

from conftest import make_tiny_workspace
from tidespec.adapters import versioning
from tidespec.adapters.publish import apply_retention
from tidespec.capture.snapshots import list_snapshots

pytestmark = pytest.mark.services
ROOT = Path(__file__).resolve().parents[1]


def _bucket(endpoint: str, name: str) -> str:
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return name


TAU_KEYS = ("acceptance_length", "acceptance_rate", "num_drafts", "num_accepted_tokens", "mismatches")


def test_fresh_clone_reproduces_older_cycle_metrics(tmp_path, aws_env, tiny_target_dir, monkeypatch, mlflow_server):
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)  # the register stage
    bucket = _bucket(aws_env, "tidespec-repro")
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(ROOT / "dvc.yaml", repo / "dvc.yaml")
    ws, params, target = make_tiny_workspace(repo, tiny_target_dir, n_requests=16, champion=True)
    versioning.ensure_repo(repo, f"s3://{bucket}/dvc", remote_name="s3", endpoint_url=aws_env)
    versioning.track(repo, ws.champion)
    (s1,) = list_snapshots(ws.snapshots, target.target_id)
    versioning.track(repo, s1)
    out = versioning.repro(repo)
    assert "curate" in out and "register" in out and (repo / "dvc.lock").exists()
    m1 = json.loads(ws.eval_report.read_text())
    t1 = json.loads((ws.candidate / "train_metrics.json").read_text())
    assert m1["lossless"] is True and m1["candidate"]["num_drafts"] > 0 and m1["champion"] is not None
    # the dvc repro route registers with lineage: the DVC rev of the curated snapshot, the params hash
    from mlflow import MlflowClient

    from tidespec.adapters import registry
    reg = json.loads((ws.work / "register.json").read_text())
    mv = MlflowClient(mlflow_server).get_model_version(registry.model_name(target.target_id), reg["version"])
    rev1 = versioning.snapshot_rev(repo, s1)
    assert json.loads(mv.tags["snapshot_revs"]) == {s1.name: rev1} and mv.tags["snapshot_rev"] == rev1
    assert rev1.endswith(".dir") and mv.tags["params_sha"] == params.sha() and mv.tags["trigger"] == "dvc-repro"
    again = versioning.repro(repo)  # nothing changed: every stage is skipped
    assert "didn't change" in again or "up to date" in again, again
    versioning.push(repo)
    versioning.git(repo, "add", "-A")
    versioning.git(repo, "commit", "-q", "-m", "cycle 1")
    c1 = versioning.git(repo, "rev-parse", "HEAD").stdout.strip()
    # cycle 2, `make repro` after ordinary serving: two more seals, and retention (capture.keep_local_snapshots:
    # 2) left s1 on the remote only; a cleaned disk lost s3's local copy too (its pointer stays)
    recipe = re.search(r"^repro:.*\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert f"/bin/dvc {' '.join(versioning.REPRO_ARGS)} &&" in recipe  # what make repro runs is what runs here
    make_tiny_workspace(repo, tiny_target_dir, n_requests=16, champion=False, seed=7)
    s2 = list_snapshots(ws.snapshots, target.target_id)[-1]
    make_tiny_workspace(repo, tiny_target_dir, n_requests=16, champion=False, seed=8)
    s3 = list_snapshots(ws.snapshots, target.target_id)[-1]
    assert len({s1, s2, s3}) == 3
    for s in (s2, s3):
        versioning.track(repo, s)
    versioning.push(repo)
    assert apply_retention(repo, ws.snapshots, target.target_id, params.capture.keep_local_snapshots) == [s1.name]
    versioning.drop_local(repo, s3, keep=[s2])
    assert not s1.exists() and not s3.exists() and s3.with_name(s3.name + ".dvc").exists()
    with pytest.raises(versioning.VersioningError, match="missing data 'source'"):
        versioning.dvc(repo, "repro")  # plain dvc repro stops at once on a snapshot left on the remote
    out = versioning.repro(repo)  # make repro's: skips s1 (outside the window), curate pulls s3 (inside)
    assert "Running stage 'curate'" in out and (s3 / "snapshot.json").exists() and not s1.exists(), out
    window = [Path(x).name for x in json.loads(ws.curated.read_text())["snapshots"]]
    assert window == [s2.name, s3.name], window
    t2 = json.loads((ws.candidate / "train_metrics.json").read_text())  # twice the traffic changed the cycle
    assert t2["train_tokens"] > t1["train_tokens"] and t2["train/loss"][-1] != t1["train/loss"][-1]
    # fresh clone of the older cycle: pull its inputs from S3, rerun every stage
    clone = tmp_path / "clone"
    versioning.git(tmp_path, "clone", "-q", str(repo), str(clone))
    versioning.git(clone, "checkout", "-q", c1)
    assert not (clone / "data" / "snapshots" / target.target_id / s2.name).exists()
    versioning.pull(clone)
    out = versioning.dvc(clone, "repro", "--force")
    assert "curate" in out and "evaluate" in out
    r1 = json.loads((clone / "data" / "work" / "eval.json").read_text())
    for who in ("champion", "candidate"):
        for k in TAU_KEYS:
            assert r1[who][k] == pytest.approx(m1[who][k]), (who, k)
    assert r1["num_prompts"] == m1["num_prompts"] and r1["lossless"] is True
    rt = json.loads((clone / "data" / "work" / "candidate" / "train_metrics.json").read_text())
    assert rt["train/loss"] == pytest.approx(t1["train/loss"], rel=1e-5)
