"""`dvc repro` (dvc.yaml: curate → train → evaluate) on a tiny snapshot in a temp git repo + local remote."""
import json
import os
import shutil
import sys
from pathlib import Path

from conftest import make_tiny_workspace
from tidespec import versioning

ROOT = Path(__file__).resolve().parents[1]


def test_dvc_repro_reruns_cycle(tmp_path, tiny_target_dir, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(ROOT / "dvc.yaml", repo / "dvc.yaml")
    ws, params, target = make_tiny_workspace(repo, tiny_target_dir, champion=True)
    versioning.ensure_repo(repo, str(tmp_path / "remote"))
    snap = next((ws.snapshots / target.target_id).iterdir())
    rev = versioning.track(repo, snap)
    versioning.push(repo)
    assert rev.endswith(".dir") and any((tmp_path / "remote").rglob("*"))
    # the stages call the `tidespec` console script of this environment
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    out = versioning.repro(repo)
    assert "curate" in out and "evaluate" in out
    rep = json.loads((repo / "data" / "work" / "eval.json").read_text())
    assert rep["lossless"] is True and rep["num_prompts"] == 3
    assert rep["candidate"]["num_drafts"] > 0 and rep["champion"] is not None
    assert (repo / "dvc.lock").exists() and (repo / "data" / "work" / "candidate" / "model.safetensors").exists()
    again = versioning.repro(repo)  # nothing changed: every stage is skipped
    assert "didn't change" in again or "up to date" in again, again
