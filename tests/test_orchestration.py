"""prefect.yaml deployments against a real Prefect server + process worker: schedule, event trigger,
concurrency limit; an event starts a real cycle run on the tiny target."""
import pytest

from conftest import copy_prefect_project, make_tiny_workspace

pytestmark = pytest.mark.services


def _project(tmp_path, tiny_target_dir):
    copy_prefect_project(tmp_path)  # prefect.yaml + flows/: the worker loads flows/*.py from this directory
    return make_tiny_workspace(tmp_path, tiny_target_dir)


def _client_call(api, fn):
    from tidespec.adapters.orchestrate import _call
    return _call(api, fn)


def test_deployments_schedule_trigger_and_event_run(tmp_path, tiny_target_dir, prefect_server, prefect_worker,
                                                    mlflow_server):
    from tidespec.adapters import orchestrate, registry

    ws, params, target = _project(tmp_path, tiny_target_dir)
    orchestrate.deploy(tmp_path, prefect_server)
    dep = _client_call(prefect_server, lambda c: c.read_deployment_by_name(orchestrate.CYCLE_DEPLOYMENT))
    train = _client_call(prefect_server, lambda c: c.read_deployment_by_name(orchestrate.TRAIN_DEPLOYMENT))
    # schedule, pool, concurrency, pull step = the project dir
    assert dep.work_pool_name == "tidespec" and train.work_pool_name == "tidespec-train"
    assert dep.entrypoint == "flows/cycle.py:tide_cycle" and train.entrypoint == "flows/train.py:tide_train"
    assert [s.schedule.interval.total_seconds() for s in dep.schedules] == [21600.0]
    assert all(s.active for s in dep.schedules)
    assert dep.global_concurrency_limit is not None and dep.global_concurrency_limit.limit == 1
    assert dep.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(tmp_path)}}]
    assert dep.parameters == {"root": ".", "params_path": "params.yaml"}
    # the event trigger, as an automation owned by the deployment
    autos = _client_call(prefect_server, lambda c: c.read_resource_related_automations(
        f"prefect.deployment.{dep.id}"))
    assert len(autos) == 1
    trig = autos[0].trigger
    assert trig.expect == {orchestrate.CAPTURE_THRESHOLD} and trig.posture == "Reactive"
    assert trig.match.model_dump()["prefect.resource.id"] == "tidespec.snapshot.*"
    act = autos[0].actions[0]
    assert act.type == "run-deployment" and act.parameters["snapshot_rev"] == "{{ (event.payload.snapshot_rev or '') }}"

    # the publisher's event starts a cycle run on the worker, with parameters from the payload
    eid = orchestrate.capture_threshold("snap-test", target.target_id, {"trigger": "tokens", "snapshot_rev": "rev-abc"},
                                   api_url=prefect_server)
    assert eid
    run = orchestrate.wait_for_run(prefect_server, orchestrate.CYCLE_DEPLOYMENT, {"snapshot_rev": "rev-abc"}, 300)
    assert run.state.is_completed(), run.state
    assert run.parameters["target_id"] == target.target_id and run.parameters["trigger"] == "tokens"
    champ = registry.champion(mlflow_server, target.target_id)
    assert champ is not None and champ.tags["snapshot_rev"] == "rev-abc"
    import json
    revs = json.loads(champ.tags["snapshot_revs"])  # lineage: every snapshot of the curated window
    assert sorted(revs) == sorted(p.name for p in (ws.snapshots / target.target_id).iterdir() if p.is_dir())
    assert all(revs.values()) and champ.tags["params_sha"] == params.sha()
    assert champ.tags["holdout_split"] == "random"  # which holdout the gate scored
    assert sorted(p.name for p in (ws.champion / "draft").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]  # deployed locally by the run, in the project dir: what vLLM / SGLang load
    # another emitter's partial payload still starts a run ("" for what is missing); nothing new → skipped
    orchestrate.emit(orchestrate.CAPTURE_THRESHOLD, "tidespec.snapshot.other", {"snapshot_rev": "rev-partial"},
                api_url=prefect_server)
    run2 = orchestrate.wait_for_run(prefect_server, orchestrate.CYCLE_DEPLOYMENT, {"snapshot_rev": "rev-partial"}, 300)
    assert run2.state.is_completed() and run2.parameters["target_id"] == "" and run2.parameters["trigger"] == "event"
    assert registry.champion(mlflow_server, target.target_id).version == champ.version


def test_train_on_another_pool(tmp_path, tiny_target_dir, prefect_server, prefect_worker, mlflow_server,
                               services_state_dir):
    """train.work_pool set: the cycle's train step runs as deployment tide-train on that pool's own
    worker; stopping that worker leaves the others (and the servers) running."""
    import psutil
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tidespec.adapters import orchestrate, services

    ws, params, target = _project(tmp_path, tiny_target_dir)
    tide_cycle = orchestrate.load_flow("tide_cycle", tmp_path)  # from the project's flows/cycle.py
    text = (tmp_path / "params.yaml").read_text().replace("train: {", "train: {work_pool: tidespec-train, ")
    (tmp_path / "params.yaml").write_text(text)
    orchestrate.deploy(tmp_path, prefect_server)
    again = services.up(services_state_dir, which=("prefect", "mlflow", "worker"), pools=("tidespec-train",))
    assert again["worker"].pid == prefect_worker.pid  # idempotent: the running worker is reused
    tw = again["worker-tidespec-train"]
    try:
        with temporary_settings({PREFECT_API_URL: prefect_server}):
            res = tide_cycle(root=str(tmp_path), params_path=str(tmp_path / "params.yaml"),
                                      target_id=target.target_id, tracking_uri=mlflow_server)
        # the train run: a tide_train flow run of the tide-train deployment, completed
        run = orchestrate.wait_for_run(prefect_server, orchestrate.TRAIN_DEPLOYMENT, {"out": str(ws.candidate)}, 30)
        assert run.state.is_completed()
        assert res["train"]["train_examples"] > 0 and res["register"]["promoted"] is True
        assert (ws.candidate / "model.safetensors").exists()
    finally:
        assert services.down(services_state_dir, which=("worker-tidespec-train",)) == ["worker-tidespec-train"]
    assert not psutil.pid_exists(tw.pid) or psutil.Process(tw.pid).status() == psutil.STATUS_ZOMBIE
    st = services.status(services_state_dir)
    assert st["worker"]["healthy"] and st["prefect"]["healthy"] and "worker-tidespec-train" not in st


def test_train_pool_mismatch_names_the_fix(tmp_path, tiny_target_dir, prefect_server):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tidespec.adapters import orchestrate

    _project(tmp_path, tiny_target_dir)
    orchestrate.deploy(tmp_path, prefect_server, names=("tide-train",))
    with temporary_settings({PREFECT_API_URL: prefect_server}):
        with pytest.raises(orchestrate.OrchestrationError, match="set train.work_pool to it"):
            orchestrate.train_on_pool("gpu-pool", {}, tmp_path / "out")


def test_await_worker_waits_for_a_first_heartbeat(monkeypatch):
    """A just-started worker answers its healthcheck before the server has its heartbeat: the
    train step waits for it (up to worker_wait_s) instead of failing at once."""
    from tidespec.adapters import orchestrate

    seen = iter([[], [], ["tidespec-worker-train"]])
    monkeypatch.setattr(orchestrate, "_polling_workers", lambda api, pool: next(seen))
    monkeypatch.setattr("time.sleep", lambda s: None)
    assert orchestrate._await_worker("http://x/api", "train", 30) == ["tidespec-worker-train"]
    monkeypatch.setattr(orchestrate, "_polling_workers", lambda api, pool: [])
    assert orchestrate._await_worker("http://x/api", "train", 0) == []


def test_is_transient_classifies_real_errors():
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from tidespec.adapters import registry
    from tidespec.adapters.orchestrate import is_transient
    from tidespec.adapters.services import free_port

    port = free_port()  # nothing listens: a real connection-refused, as MLflow raises it
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        with pytest.raises(MlflowException) as down:
            MlflowClient(f"http://127.0.0.1:{port}").get_experiment_by_name("x")
    assert is_transient(down.value)
    assert not is_transient(ValueError("curated set is for another target"))
    assert not is_transient(registry.RegistryError("no champion to roll back"))
    assert not is_transient(FileNotFoundError("holdout missing"))
    try:
        try:
            raise ConnectionResetError("peer reset")
        except ConnectionResetError as e:
            raise RuntimeError("upload failed") from e
    except RuntimeError as wrapped:
        assert is_transient(wrapped)


def test_tasks_retry_only_transient_failures(prefect_server):
    """A task with the flow's retry policy retries a connection error, not bad data."""
    from prefect import flow, task
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tidespec.adapters.orchestrate import retry_if_transient

    calls = {"conn": 0, "data": 0}

    @task(retries=2, retry_delay_seconds=0, retry_condition_fn=retry_if_transient)
    def flaky(kind):
        calls[kind] += 1
        if kind == "conn" and calls[kind] < 3:
            raise ConnectionRefusedError("mlflow down")
        if kind == "data":
            raise ValueError("bad record")
        return calls[kind]

    @flow
    def f():
        ok = flaky("conn")
        fut = flaky.submit("data")
        fut.wait()
        return ok, fut.state.is_failed()

    with temporary_settings({PREFECT_API_URL: prefect_server}):
        ok, data_failed = f()
    assert calls == {"conn": 3, "data": 1}  # 2 retries after connection errors; none after bad data
    assert ok == 3 and data_failed


def test_mlflow_5xx_is_transient_4xx_is_not():
    """An overloaded server (5xx/429, as a proxy in front of MLflow answers) is transient once the
    client has given up retrying; a 404 is not."""
    import http.server
    import threading

    from mlflow import MlflowClient

    from tidespec.adapters.orchestrate import is_transient

    code = {"v": 503}

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(code["v"])
            self.end_headers()

        def log_message(self, *a):
            pass
    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    got = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        mp.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
        for c in (503, 500, 429, 404):
            code["v"] = c
            with pytest.raises(Exception) as e:
                MlflowClient(f"http://127.0.0.1:{srv.server_port}").get_experiment("1")
            got[c] = is_transient(e.value)
    srv.shutdown()
    assert got == {503: True, 500: True, 429: True, 404: False}
    try:  # bad data raised while handling a connection error stays bad data
        try:
            raise ConnectionError("reset")
        except ConnectionError:
            raise ValueError("curated set is for another target")  # noqa: B904 - the chaining is what is tested
    except ValueError as e:
        assert not is_transient(e)


def test_crash_runs_frees_a_dead_workers_runs(tmp_path, tiny_target_dir, prefect_server):
    """services.down marks the runs of a stopped worker Crashed: a run left Running would hold the
    deployment's concurrency slot."""
    from prefect.states import Running

    from tidespec.adapters import orchestrate

    _project(tmp_path, tiny_target_dir)
    orchestrate.deploy(tmp_path, prefect_server, names=("tide-train",))

    async def running(c):
        dep = await c.read_deployment_by_name(orchestrate.TRAIN_DEPLOYMENT)
        run = await c.create_flow_run_from_deployment(dep.id, parameters={"curated": "x", "out": "y"})
        await c.set_flow_run_state(run.id, Running(), force=True)
        return run
    run = _client_call(prefect_server, running)
    assert orchestrate.crash_runs(prefect_server, "tidespec-train", "worker stopped") == [run.name]
    after = _client_call(prefect_server, lambda c: c.read_flow_run(run.id))
    assert after.state.is_crashed() and after.state.message == "worker stopped"
    assert orchestrate.crash_runs(prefect_server, "tidespec-train", "again") == []
