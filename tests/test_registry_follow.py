"""A replica on another machine follows the registry, not a directory (`serve.champion_source:
registry`), on a real MLflow server: `registry.RegistryFollower` materializes the champion alias and
the class champions into the server's own state dir by rename, and keeps what it holds when the
registry cannot be reached; a `tidespec serve` process with no local champion serves the registry's,
and the next one promoted there."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from dataclasses import replace

import pytest
import yaml

from conftest import health, make_tiny_target, random_draft, tiny_params_yaml, wait_until
from tidespec.adapters import registry
from tidespec.models.eagle3 import save_checkpoint
from tidespec.workspace import served_version

pytestmark = pytest.mark.services


def _register(uri, tid, target, tmp_path, seed, workload="", target_id=None):
    """A random draft for `target` registered as an evaluated version of `tid` (its config's target id
    `target_id`: "" for a registered model of the test's own); returns the version."""
    d = random_draft(target, 64, seed=seed)
    if target_id is not None:
        d.config = replace(d.config, target_id=target_id)
    tags = {"lossless": "True"} | ({"workload": workload} if workload else {})
    ck = save_checkpoint(d, tmp_path / f"ck{seed}")
    return registry.log_candidate(uri, tid, ck, {"k": 3}, {"acceptance_length": 1.5 + seed / 10}, tags)[1]


def _files(d):
    return {p.relative_to(d): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_the_follower_materializes_the_champions_by_rename_and_keeps_them_when_the_registry_is_gone(
        tmp_path, tiny_target, mlflow_server, monkeypatch):
    from tidespec.adapters.services import free_port
    uri, tid = mlflow_server, uuid.uuid4().hex * 2  # a registered model of its own
    state = tmp_path / "replica" / ".tidespec" / "registry"
    champ, classes = state / "champion", state / "classes"
    follower = registry.RegistryFollower(uri, tid, champ, classes, 0)  # 0: no thread, the test runs the rounds
    try:
        assert follower.check() == {} and not champ.exists()  # no model yet: nothing to follow
        v1 = _register(uri, tid, tiny_target, tmp_path, 1, target_id="")
        registry.promote(uri, tid, v1, "first")
        assert follower.check() == {"": v1} and served_version(champ) == v1
        assert (champ / "draft" / "model.safetensors").is_file()
        assert follower.check() == {}  # the same version: nothing downloaded
        v2 = _register(uri, tid, tiny_target, tmp_path, 2, target_id="")
        registry.promote(uri, tid, v2, "better")
        assert follower.check() == {"": v2} and served_version(champ) == v2
        assert sorted(p.name for p in state.iterdir()) == ["champion"]  # the scratch went with the rename

        code = _register(uri, tid, tiny_target, tmp_path, 3, workload="code", target_id="")
        registry.promote(uri, tid, code, "its own", workload="code")
        assert follower.check() == {"code": code} and served_version(classes / "code") == code
        registry.rollback(uri, tid, "live acceptance fell", workload="code")  # back to the generalist
        assert follower.check() == {"code": None} and not (classes / "code").exists()
        assert [p.name for p in classes.iterdir()] == []

        held = _files(champ)
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        gone = registry.RegistryFollower(f"http://127.0.0.1:{free_port()}", tid, champ, classes, 0)
        assert gone.check() == {} and "MlflowException" in gone.error  # logged, never raised
        assert _files(champ) == held and sorted(p.name for p in state.iterdir()) == ["champion", "classes"]
        assert gone.first_round(30) and gone.error is not None
    finally:
        follower.close()


def test_a_replica_with_no_local_champion_serves_the_registrys_and_follows_it(tmp_path, mlflow_server):
    """`tidespec serve` (embedded) in a root with no data/drafts/champion, serve.champion_source:
    registry: it starts on the registry's champion, and serves the next one promoted there, with
    nothing written under data/drafts."""
    from tidespec.adapters.services import free_port
    from tidespec.config import load_params
    from tidespec.models.load import get_target
    from tidespec.workspace import Workspace
    root = tmp_path / "replica"
    root.mkdir()
    raw = yaml.safe_load(tiny_params_yaml(make_tiny_target(tmp_path / "target", seed=56)))  # its own model
    raw["serve"] = {"watch_champion_s": 0.5, "champion_source": "registry"}
    raw["engine"]["adaptive"] = False  # fixed k: no calibration at start
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    target = get_target(load_params(root / "params.yaml"))[0]
    uri, tid = mlflow_server, target.target_id
    v1 = _register(uri, tid, target, tmp_path, 1)
    registry.promote(uri, tid, v1, "first")
    v2 = _register(uri, tid, target, tmp_path, 2)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tidespec.cli", "serve", "--root", str(root), "--params",
                                 str(root / "params.yaml"), "--port", str(port), "--no-capture"], cwd=root,
                                env=os.environ | {"MLFLOW_TRACKING_URI": uri}, stdout=log, stderr=subprocess.STDOUT)
        try:
            assert wait_until(lambda: health(url), 120, "/health", proc)["draft_version"] == v1
            registry.promote(uri, tid, v2, "next")
            wait_until(lambda: (h := health(url)) and h["draft_version"] == v2, 30, f"the server to serve v{v2}",
                       proc)
        finally:
            proc.terminate()
            proc.wait(60)
    out = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in out, out
    assert f"following the registry at {uri}: champion {v1}" in " ".join(out.split()), out
    ws = Workspace(root)
    assert not ws.drafts.exists()  # nothing written where a local cycle deploys
    assert served_version(ws.served_champions("registry")[0]) == v2
