"""DVC versioning in a throwaway git repo with a local-directory remote."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from tidespec.adapters import versioning


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """One repo for the module (each dvc call costs ~1 s); tests use distinct paths in it."""
    root = tmp_path_factory.mktemp("dvc")
    r = root / "repo"
    versioning.ensure_repo(r, str(root / "remote"))
    versioning.ensure_repo(r, str(root / "remote"))  # idempotent
    return r


def test_track_push_delete_pull_roundtrip(repo):
    snap = repo / "data" / "snap1"
    (snap / "shards").mkdir(parents=True)
    (snap / "manifest.jsonl").write_text('{"request_id": "r1"}\n')
    (snap / "shards" / "000.safetensors").write_bytes(bytes(range(256)) * 64)
    want = _files(snap)

    rev = versioning.track(repo, Path("data/snap1"))
    assert rev.endswith(".dir") and rev == versioning.snapshot_rev(repo, Path("data/snap1"))
    sha = versioning.commit_git(repo, "track snap1")
    assert sha and versioning.commit_git(repo, "again") is None
    assert versioning.git(repo, "status", "--porcelain", "data").stdout == ""
    versioning.push(repo, [Path("data/snap1")])

    shutil.rmtree(snap)
    shutil.rmtree(repo / ".dvc" / "cache")
    versioning.pull(repo, [repo / "data" / "snap1"])
    assert _files(snap) == want


def test_snapshot_rev_is_content_hash(repo):
    for name in ("a", "b"):
        d = repo / name
        d.mkdir()
        (d / "x.bin").write_bytes(b"same content")
    ra, rb = versioning.track(repo, Path("a")), versioning.track(repo, Path("b"))
    assert ra == rb
    assert versioning.track(repo, Path("a")) == ra  # re-add unchanged: same rev
    (repo / "a" / "x.bin").write_bytes(b"other content")
    assert versioning.track(repo, Path("a")) != ra


def test_errors_name_command_and_fix(tmp_path):
    with pytest.raises(versioning.VersioningError) as e:
        versioning.push(tmp_path)  # not a repo
    assert "dvc push" in str(e.value) and "ensure_repo" in e.value.hint


def test_repro_runs_stage_and_commits_lock(repo):
    (repo / "src.txt").write_text("in\n")
    (repo / "dvc.yaml").write_text(
        "stages:\n  copy:\n    cmd: cp src.txt out.txt\n    deps: [src.txt]\n    outs: [out.txt]\n")
    out = versioning.repro(repo, "copy")
    assert "copy" in out and (repo / "out.txt").read_text() == "in\n"
    assert versioning.commit_git(repo, "repro copy")
    assert "dvc.lock" in versioning.git(repo, "show", "--name-only", "HEAD").stdout


def test_machine_local_remote_stays_out_of_project_config(tmp_path):
    r = tmp_path / "repo"
    versioning.ensure_repo(r, str(tmp_path / "remote"), machine_local=True)
    assert str(tmp_path / "remote") in (r / ".dvc" / "config.local").read_text()
    assert "remote" not in (r / ".dvc" / "config").read_text()
    (r / "d").mkdir()
    (r / "d" / "x").write_text("1")
    versioning.track(r, r / "d")
    versioning.push(r)
    assert any((tmp_path / "remote").rglob("*"))


def _publishing_writer(tmp_path, keep_local: int, **writer_kw):
    """A DVC repo whose remote is unusable (a file), a Publisher and a CaptureWriter publishing through
    it, with one record "a" submitted. Returns (repo, remote, snapshots root, publisher, writer, record)."""
    import torch

    from tidespec.adapters.publish import Publisher
    from tidespec.capture.writer import CaptureWriter
    r, remote = tmp_path / "repo", tmp_path / "remote"
    versioning.ensure_repo(r, str(remote))
    shutil.rmtree(remote)
    remote.write_text("not a directory")  # the remote is unusable
    snaps = r / "data" / "snapshots"
    pub = Publisher(r, snaps, keep_local=keep_local, emit=False, commit=False)
    w = CaptureWriter(r / "data" / "capture", "tid", snapshots_root=snaps, on_seal=pub, **writer_kw)
    rec = {"input_ids": torch.arange(8, dtype=torch.int32), "loss_mask": torch.ones(8, dtype=torch.uint8),
           "aux_hidden_states": torch.zeros(8, 6), "hidden_states": torch.zeros(8, 2)}
    w.submit(rec, request_id="a", workload="x", acceptance_length=1.0)
    return r, remote, snaps, pub, w, rec


def test_failed_publish_is_retried_by_the_next(tmp_path):
    """Remote down during one publish: the snapshot stays local; the next publish pushes it too,
    and only then may retention drop it."""
    r, remote, snaps, pub, w, rec = _publishing_writer(tmp_path, keep_local=1, publish_attempts=1)
    first = w.seal_now()
    w._publisher._pool.submit(lambda: None).result()  # wait for the publisher
    assert w.stats().publish_errors == 1 and (snaps / "tid" / first.snapshot_id).exists()
    remote.unlink()  # the remote is back
    remote.mkdir(mode=0o700)
    w.submit(dict(rec, input_ids=rec["input_ids"] + 1), request_id="b", workload="x", acceptance_length=1.0)
    second = w.seal_now()
    w.close()
    assert pub.published[-1]["dropped_local"] == [first.snapshot_id]  # keep_local=1, and now it is on the remote
    assert (snaps / "tid" / f"{first.snapshot_id}.dvc").exists() and (snaps / "tid" / second.snapshot_id).exists()
    versioning.pull(r, [snaps / "tid" / f"{first.snapshot_id}.dvc"])
    assert (snaps / "tid" / first.snapshot_id / "manifest.jsonl").exists()


def test_failed_publish_retries_by_itself(tmp_path):
    """Remote down at the seal, back before the retry: the same snapshot is published by the
    writer's own retry (no second seal), counted once as an error, then pushed and tracked."""
    r, remote, snaps, pub, w, rec = _publishing_writer(tmp_path, keep_local=4, publish_retry_s=3.0)
    snap = w.seal_now()
    deadline = time.monotonic() + 60
    while w.stats().publish_errors == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    remote.unlink()  # back within the 3 s backoff
    remote.mkdir(mode=0o700)
    while not pub.published and time.monotonic() < deadline:
        time.sleep(0.1)
    w.close()
    assert w.stats().publish_errors == 1 and [p["snapshot_id"] for p in pub.published] == [snap.snapshot_id]
    assert (snaps / "tid" / f"{snap.snapshot_id}.dvc").exists() and any(remote.rglob("*"))


def test_drift_above_threshold_triggers_a_cycle_event(tmp_path, monkeypatch):
    """A snapshot sealed by hand (no token trigger) still asks for a cycle when its workload drifted
    from the last curated set; a repeat of the same workload does not."""
    from test_capture import _text_records
    from tidespec.adapters import orchestrate
    from tidespec.adapters.publish import Publisher
    from tidespec.assets import prompts
    from tidespec.capture.curate import curate
    from tidespec.capture.snapshots import seal
    from tidespec.capture.writer import CaptureWriter
    from tidespec.config import CurateParams
    sent = []
    monkeypatch.setattr(orchestrate, "capture_threshold", lambda sid, tid, payload: sent.append(payload) or "ev")
    r = tmp_path / "repo"
    versioning.ensure_repo(r, str(tmp_path / "remote"))
    snaps = r / "data" / "snapshots"
    code, math = [p.text for p in prompts.load("humaneval")], [p.text for p in prompts.load("gsm-en")]

    def snapshot(name, texts):
        w = CaptureWriter(r / "data" / "capture" / name, "tid")
        for rid, rec in _text_records(texts, name):
            w.submit(rec, request_id=rid, workload=name, acceptance_length=1.0)
        w.close()
        return seal(r / "data" / "capture" / name, snaps, "tid")

    snapshot("code1", code[:40])
    curate(snaps, "tid", CurateParams(window=1), r / "data" / "work" / "curated.json")
    pub = Publisher(r, snaps, keep_local=8, curated=r / "data" / "work" / "curated.json", drift_threshold=0.05,
                    commit=False)
    repeat = pub(snapshot("code2", code[40:80]))
    shift = pub(snapshot("math", math[:40]))
    assert repeat["trigger"] is None and repeat["drift_jsd"] < 0.03 and repeat["event_id"] is None
    assert shift["trigger"] == "drift" and shift["drift_jsd"] > 0.05 and shift["event_id"] == "ev"
    assert [p["trigger"] for p in sent] == ["drift"] and sent[0]["drift_jsd"] == shift["drift_jsd"]


def test_the_demos_dvc_setup_leaves_a_fresh_clone_clean(tmp_path):
    """`make demo` sets DVC up in the user's checkout (`ensure_repo(machine_local=True)`). The checkout
    is a DVC project already (.dvc/config, .dvc/.gitignore and .dvcignore are committed), so nothing is
    staged or changed in git: the remote goes to the git-ignored .dvc/config.local."""
    import subprocess
    from pathlib import Path

    from tidespec.adapters import versioning
    repo, clone = Path(__file__).resolve().parents[1], tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    versioning.ensure_repo(clone, str(tmp_path / "remote"), machine_local=True)
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True,
                            check=True).stdout
    assert status == "" and "remote" in (clone / ".dvc" / "config.local").read_text()
