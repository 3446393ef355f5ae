"""A worker on another machine (docs/fleet.md): `tidespec fleet deploy` publishes the deployment's
bundle (params.yaml + flows/) to the DVC remote and deploys the cycle with a pull step that prepares
the worker's own workspace; a process worker whose flow runs start in clean directories runs a cycle
there, fed by nothing but the DVC remote, the registry and Prefect. Real Prefect server + worker,
MLflow, DVC (a local remote; the bundle on a moto S3 remote too)."""
import hashlib
import json
import os
from pathlib import Path

import pytest
import yaml

from conftest import REPO, make_tiny_target, make_tiny_workspace, tiny_params_yaml
from tidespec.adapters import fleet_deploy, orchestrate
from tidespec.adapters.remote_snapshots import RemoteIndex
from tidespec.config import Params, load_params

OLD = 1_000_000_000  # an access time long past: relatime moves it on the next read


def _fleet_yaml(target_dir) -> str:
    return tiny_params_yaml(target_dir).replace("curate: {", "curate: {fleet: true, ")


def test_fleet_params_and_names_are_checked_before_anything_is_published(tmp_path):
    assert "curate.fleet: true" in fleet_deploy.fleet_refusal(Params())
    wp = Params.model_validate({"curate": {"fleet": True}, "train": {"work_pool": "gpu"}})
    assert "unset it" in fleet_deploy.fleet_refusal(wp)
    assert fleet_deploy.fleet_refusal(Params.model_validate({"curate": {"fleet": True}})) is None
    from typer.testing import CliRunner

    from tidespec.cli import app
    (tmp_path / "params.yaml").write_text("curate: {window: 2}\n")
    remote = tmp_path / "remote"
    r = CliRunner().invoke(app, ["fleet", "deploy", "--remote", str(remote), "--params", str(tmp_path / "params.yaml")],
                           env={"PREFECT_API_URL": "http://127.0.0.1:9/api"})
    assert isinstance(r.exception, ValueError) and "set curate.fleet: true" in str(r.exception)
    with pytest.raises(ValueError, match="--name"):
        fleet_deploy.deploy_fleet(REPO, "http://127.0.0.1:9/api", str(remote), tmp_path / "params.yaml",
                                  name="../x")
    assert not remote.exists()  # refused before anything reached the remote
    with pytest.raises(ValueError, match="absolute path"):
        RemoteIndex.at("relative/remote")


def test_the_fleet_deployment_is_prefect_yaml_s_cycle_with_a_pull_step():
    step = {fleet_deploy.PULL_STEP: {"remote": "s3://b/dvc", "name": "tide-cycle", "bundle": "ab"}}
    doc = fleet_deploy.fleet_deployment(REPO, "tide-cycle", "gpu-workers", step)
    mine = yaml.safe_load((REPO / "prefect.yaml").read_text())
    base = next(d for d in mine["deployments"] if d["name"] == "tide-cycle")
    (dep,) = doc["deployments"]
    assert dep["pull"] == [step] and dep["work_pool"]["name"] == "gpu-workers"
    assert dep["entrypoint"] == base["entrypoint"] == "flows/cycle.py:tide_cycle"
    assert dep["parameters"] == {"root": ".", "params_path": "params.yaml"}
    for key in ("triggers", "schedules", "concurrency_limit", "tags"):  # prefect.yaml stays the one source
        assert dep[key] == base[key]
    assert doc["name"] == mine["name"] and "pull" not in base  # the one-checkout deployment keeps no pull step
    assert fleet_deploy.PULL_STEP == "tidespec.adapters.fleet_deploy.prepare_worker"
    # deploy.rollout: canary — the canary's decision is deployed beside the cycle, same pull step and pool
    both = fleet_deploy.fleet_deployment(REPO, "tide-cycle", "gpu-workers", step,
                                         (fleet_deploy.CYCLE_FLOW, fleet_deploy.ROLLOUT_FLOW))["deployments"]
    rollout = next(d for d in mine["deployments"] if d["name"] == "tide-rollout")
    assert [d["entrypoint"] for d in both] == ["flows/cycle.py:tide_cycle", rollout["entrypoint"]]
    assert both[1]["pull"] == [step] and both[1]["work_pool"]["name"] == "gpu-workers"
    assert both[1]["name"] == "tide-cycle" and both[1]["schedules"] == rollout["schedules"]


@pytest.mark.services
def test_a_bundle_on_s3_prepares_a_worker(tmp_path, aws_env, monkeypatch):
    import boto3

    from tidespec.adapters import versioning
    boto3.client("s3", endpoint_url=aws_env).create_bucket(Bucket="fleet-worker")
    remote = "s3://fleet-worker/dvc"
    files = {"params.yaml": "curate: {fleet: true}\n", "flows/cycle.py": "# the flow\n"}
    bundle = fleet_deploy.publish_bundle(RemoteIndex.at(remote, aws_env), "cyc", files)
    key = f"dvc/tidespec/deployments/cyc/{bundle}.json"
    assert boto3.client("s3", endpoint_url=aws_env).head_object(Bucket="fleet-worker", Key=key)[
        "ServerSideEncryption"] == "AES256"
    monkeypatch.setenv(fleet_deploy.HOME_ENV, str(tmp_path / "home"))
    got = fleet_deploy.prepare_worker(remote, "cyc", bundle, endpoint_url=aws_env)
    root = tmp_path / "home" / "cyc"
    assert got == {"directory": str(root)}
    assert {p: (root / p).read_text() for p in files} == files
    cfg = versioning.dvc(root, "config", "-l", "--project")
    assert f"remote.fleet.url={remote}" in cfg and f"remote.fleet.endpointurl={aws_env}" in cfg
    assert fleet_deploy.prepare_worker(remote, "cyc", bundle, endpoint_url=aws_env) == got  # idempotent
    assert fleet_deploy.worker_root("cyc", str(tmp_path / "h")) == tmp_path / "h" / "cyc"  # --worker-home wins
    with pytest.raises(orchestrate.OrchestrationError, match="deploy it again"):
        fleet_deploy.prepare_worker(remote, "cyc", "0" * 16, endpoint_url=aws_env)


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*")) + [root]


def _fingerprint(paths: list[Path]) -> dict[str, tuple]:
    return {str(p): (p.is_dir(), p.stat().st_mtime_ns, None if p.is_dir() else hashlib.sha256(p.read_bytes()).digest())
            for p in paths}


@pytest.mark.services
def test_a_worker_on_another_machine_runs_the_cycle(tmp_path, prefect_server, mlflow_server, services_state_dir,
                                                   monkeypatch):
    """A replica (its own repo) publishes a snapshot and emits the threshold event; the fleet
    deployment's cycle runs on a worker from its own workspace and registers a champion; no file of
    the replica's root is read or written meanwhile."""
    from typer.testing import CliRunner

    from tidespec.adapters import registry, services, versioning
    from tidespec.adapters.publish import Publisher
    from tidespec.capture.snapshots import list_snapshots, load_snapshot
    from tidespec.cli import app

    target_dir = make_tiny_target(tmp_path / "target", seed=58)  # a target of its own: its first champion
    remote, replica, loop, home = (tmp_path / n for n in ("remote", "replica", "loop", "worker-home"))
    replica.mkdir()
    loop.mkdir()
    ws, _, target = make_tiny_workspace(replica, target_dir)  # params.yaml + one sealed snapshot
    (replica / "params.yaml").write_text(_fleet_yaml(target_dir))
    (loop / "params.yaml").write_text(_fleet_yaml(target_dir))  # the machine that deploys: same params
    tid = target.target_id

    monkeypatch.chdir(REPO)  # the project root: prefect.yaml and flows/
    r = CliRunner().invoke(app, ["fleet", "deploy", "--remote", str(remote), "--params", str(loop / "params.yaml"),
                                 "--pool", "tidespec-fleet-test"], env={"PREFECT_API_URL": prefect_server})
    assert r.exit_code == 0, r.output
    dep = orchestrate._call(prefect_server, lambda c: c.read_deployment_by_name(orchestrate.CYCLE_DEPLOYMENT))
    (step,) = dep.pull_steps  # tide_cycle/tide-cycle: the default name, prefect.yaml's entry
    args = step[fleet_deploy.PULL_STEP]
    assert args["remote"] == str(remote) and args["name"] == "tide-cycle" and "home" not in args
    assert dep.work_pool_name == "tidespec-fleet-test" and dep.entrypoint == "flows/cycle.py:tide_cycle"
    assert dep.parameters == {"root": ".", "params_path": "params.yaml"}
    bundle = RemoteIndex.at(str(remote)).read_doc("deployments", "tide-cycle", f"{args['bundle']}.json")
    flows = sorted(f"flows/{f.name}" for f in (REPO / "flows").glob("*.py"))  # every flow file, + params
    assert len(flows) >= 3 and sorted(bundle["files"]) == flows + ["params.yaml"]

    monkeypatch.setenv(fleet_deploy.HOME_ENV, str(home))  # the worker machine's own disk (its env)
    services.up(services_state_dir, which=("prefect", "mlflow"), pools=("tidespec-fleet-test",))
    try:
        versioning.ensure_repo(replica, str(remote))  # the replica's own repo, on the fleet's remote
        monkeypatch.setenv("PREFECT_API_URL", prefect_server)
        pub = Publisher(replica, ws.snapshots, emit=True, commit=True, fleet_min_tokens=1)(
            load_snapshot(list_snapshots(ws.snapshots, tid)[0]))
        assert pub["trigger"] == "tokens" and pub["event_id"]
        paths = _files(replica)  # from here on the replica's root is left alone: nothing reads or writes it
        before = _fingerprint(paths)
        for p in paths:
            os.utime(p, ns=(OLD * 10**9, p.stat().st_mtime_ns), follow_symlinks=False)
        run = orchestrate.wait_for_run(prefect_server, orchestrate.CYCLE_DEPLOYMENT,
                                       {"snapshot_rev": pub["snapshot_rev"]}, 240)
        read = [str(p) for p in paths if p.stat().st_atime != OLD]
    finally:
        services.down(services_state_dir, which=("worker-tidespec-fleet-test",))
    assert run.state.is_completed(), run.state
    assert read == []  # no file or folder of the replica's root was read during the cycle...
    assert _fingerprint(_files(replica)) == before  # ...or written, added or removed

    champ = registry.champion(mlflow_server, tid)  # a new champion in the registry, from the replica's snapshot
    assert champ is not None and champ.tags["snapshot_rev"] == pub["snapshot_rev"]
    assert json.loads(champ.tags["snapshot_revs"]) == {pub["snapshot_id"]: pub["snapshot_rev"]}
    wroot = home / "tide-cycle"  # the worker's workspace: its own repo on its own disk, not the replica's
    assert not wroot.is_relative_to(replica) and not replica.is_relative_to(wroot)
    assert (wroot / "params.yaml").read_text() == (loop / "params.yaml").read_text()
    assert (wroot / "flows" / "cycle.py").read_text() == (REPO / "flows" / "cycle.py").read_text()
    assert (wroot / "data" / "snapshots" / tid / f"{pub['snapshot_id']}.dvc").exists()  # rebuilt from the manifest
    assert load_params(wroot / "params.yaml").curate.fleet
    assert (wroot / "data" / "drafts" / "champion" / "version.json").exists()  # the deploy step: the worker's disk
    assert RemoteIndex.at(str(remote)).cycle_mark(tid)["through"] == pub["snapshot_id"]
