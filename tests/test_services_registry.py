"""Real MLflow/Prefect servers on loopback: registry promotion rules and service lifecycle."""

from __future__ import annotations

import json
import sqlite3
import sys
import uuid
from pathlib import Path

import numpy as np
import psutil
import pytest
from mlflow import MlflowClient
from safetensors.numpy import save_file

from tidespec.adapters import process, registry, services

pytestmark = pytest.mark.services


@pytest.fixture
def tid() -> str:
    """A fresh 64-hex target id, so tests sharing the session server never collide."""
    return uuid.uuid4().hex * 2


@pytest.fixture
def ckpt(tmp_path) -> Path:
    """A tiny fake draft checkpoint: config.json + model.safetensors."""
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 8}))
    rng = np.random.default_rng(0)
    save_file({"fc.weight": rng.standard_normal((8, 24)).astype(np.float32),
               "d2t": np.arange(4, dtype=np.int64)}, str(d / "model.safetensors"))
    return d


def _log(uri, tid, ckpt, tau, **kw):
    return registry.log_candidate(
        uri, tid, ckpt, params={"train": {"lr": 1e-4, "steps": 3}, "k": 4},
        metrics={"acceptance_length": tau, "baseline_acceptance_length": 1.0, "accepted_per_pos/0": 0.7},
        tags={"snapshot_rev": "abc.dir", "params_sha": "p1", "workload_mix": "code:1.0", "lossless": "True"},
        step_metrics={"train/loss": [3.0, 2.0, 1.5]}, **kw)


def test_first_candidate_becomes_champion(mlflow_server, tid, ckpt):
    run_id, v = _log(mlflow_server, tid, ckpt, 2.0, run_name="cand-1")
    c = MlflowClient(mlflow_server, mlflow_server)
    name = registry.model_name(tid)
    assert name == f"tidespec-draft-{tid[:12]}"
    assert c.get_model_version_by_alias(name, "challenger").version == v
    mv = c.get_model_version(name, v)
    for k in registry.VERSION_TAG_KEYS:
        assert k in mv.tags, k
    assert mv.tags["target_id"] == tid and float(mv.tags["acceptance_length"]) == 2.0
    run = c.get_run(run_id)
    assert run.data.params["train.lr"] == "0.0001" and run.data.metrics["accepted_per_pos/0"] == 0.7
    assert [m.value for m in c.get_metric_history(run_id, "train/loss")] == [3.0, 2.0, 1.5]
    assert c.get_experiment(run.info.experiment_id).name == registry.experiment_name(tid)

    assert registry.champion(mlflow_server, tid) is None
    d = registry.promote_if_better(mlflow_server, tid, v, 2.0, None, 0.02, lossless=True)
    assert d.promoted and d.previous_champion is None and d.version == v
    champ = registry.champion(mlflow_server, tid)
    assert champ.version == v and champ.run_id == run_id and champ.tags["decision"] == "promoted"


def test_worse_rejected_better_promoted_rollback(mlflow_server, tid, ckpt):
    uri = mlflow_server
    _, v1 = _log(uri, tid, ckpt, 2.0)
    assert registry.promote_if_better(uri, tid, v1, 2.0, None, 0.02, True).promoted
    with pytest.raises(registry.RegistryError, match="champion_tau"):
        registry.promote_if_better(uri, tid, v1, 2.0, None, 0.02, True)

    run2, v2 = _log(uri, tid, ckpt, 2.03)  # below 2.0 * 1.02
    d2 = registry.promote_if_better(uri, tid, v2, 2.03, 2.0, 0.02, True)
    assert not d2.promoted and d2.previous_champion == v1 and "<" in d2.reason
    c = MlflowClient(uri, uri)
    mv2 = c.get_model_version(registry.model_name(tid), v2)
    assert mv2.tags["decision"] == "rejected" and mv2.tags["decision_reason"] == d2.reason
    assert c.get_run(run2).data.tags["decision"] == "rejected"
    assert registry.champion(uri, tid).version == v1

    _, v3 = _log(uri, tid, ckpt, 2.2)
    d3 = registry.promote_if_better(uri, tid, v3, 2.2, 2.0, 0.02, True)
    assert d3.promoted and d3.previous_champion == v1
    assert registry.champion(uri, tid).version == v3

    rb = registry.rollback(uri, tid)
    assert rb.promoted and rb.version == v1 and rb.previous_champion == v3
    assert registry.champion(uri, tid).version == v1
    assert c.get_model_version(registry.model_name(tid), v3).tags["decision"] == "rolled_back"
    with pytest.raises(registry.RegistryError, match="nothing to roll back"):
        registry.rollback(uri, tid)

    d = registry.promote(uri, tid, v2, "operator override")
    assert d.promoted and d.previous_champion == v1 and registry.champion(uri, tid).version == v2
    assert registry.rollback(uri, tid).version == v1


def test_gate_refuses_when_champion_moved_during_the_cycle(mlflow_server, tid, ckpt):
    """A candidate evaluated against v1 is not promoted over a v2 promoted by hand meanwhile."""
    uri = mlflow_server
    _, v1 = _log(uri, tid, ckpt, 2.0)
    registry.promote_if_better(uri, tid, v1, 2.0, None, 0.02, True)
    _, v2 = _log(uri, tid, ckpt, 3.0)
    registry.promote(uri, tid, v2, "hotfix by hand")
    _, v3 = _log(uri, tid, ckpt, 2.1)
    d = registry.promote_if_better(uri, tid, v3, 2.1, 2.0, 0.02, True, evaluated_champion=v1)
    assert not d.promoted and f"evaluated against v{v1}, champion is now v{v2}" in d.reason
    assert registry.champion(uri, tid).version == v2
    # versions are normalised: " 1" / "01" name version 1; junk is refused with the fix
    assert registry.promote(uri, tid, f" 0{v1}", "typo").version == v1
    assert registry.champion(uri, tid).version == v1
    for bad in ("abc", "0", "-1", "99"):
        with pytest.raises(registry.RegistryError):
            registry.promote(uri, tid, bad, "x")
    # a deleted earlier champion is skipped by rollback
    MlflowClient(uri, uri).delete_model_version(registry.model_name(tid), v2)
    with pytest.raises(registry.RegistryError, match="deleted versions skipped"):
        registry.rollback(uri, tid)


def test_non_lossless_never_promoted(mlflow_server, tid, ckpt):
    _, v = _log(mlflow_server, tid, ckpt, 4.0)
    d = registry.promote_if_better(mlflow_server, tid, v, 4.0, None, 0.0, lossless=False)
    assert not d.promoted and "lossless" in d.reason
    assert registry.champion(mlflow_server, tid) is None
    _, v1 = _log(mlflow_server, tid, ckpt, 2.0)
    assert registry.promote_if_better(mlflow_server, tid, v1, 2.0, None, 0.0, True).promoted
    d = registry.promote_if_better(mlflow_server, tid, v, 4.0, 2.0, 0.0, lossless=False)
    assert not d.promoted and registry.champion(mlflow_server, tid).version == v1


def test_download_champion_identical(mlflow_server, tid, ckpt, tmp_path):
    assert registry.download_champion(mlflow_server, tid, tmp_path / "none") is None
    (ckpt / "suffix_corpus.safetensors").write_bytes(b"corpus")  # a sidecar: must not sit in the engine dir
    (ckpt / "train_metrics.json").write_text("{}")
    _, v = _log(mlflow_server, tid, ckpt, 2.0)
    registry.promote_if_better(mlflow_server, tid, v, 2.0, None, 0.02, True)
    source = registry.champion(mlflow_server, tid).source  # what a user points vLLM / SGLang at
    listed = MlflowClient(mlflow_server).list_artifacts(registry.champion(mlflow_server, tid).run_id, "draft")
    assert source.endswith("/draft") and sorted(Path(a.path).name for a in listed) == [
        "config.json",
        "model.safetensors",
    ]
    got = registry.download_champion(mlflow_server, tid, tmp_path / "dl")
    assert sorted(p.name for p in got.iterdir()) == ["draft", "suffix_corpus.safetensors", "train_metrics.json",
                                                     "version.json"]
    assert sorted(p.name for p in (got / "draft").iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((got / "version.json").read_text())["version"] == v  # what evaluate compares against
    for f in ckpt.iterdir():
        assert ((got / "draft" if f.name in ("config.json", "model.safetensors") else got) / f.name).read_bytes() \
            == f.read_bytes()
    again = registry.download_version(mlflow_server, tid, v, tmp_path / "dl2")  # the same bundle
    assert sorted(p.name for p in again.iterdir()) == sorted(p.name for p in got.iterdir())


def test_replayed_tau_k_comes_from_the_tag_or_else_from_the_runs_per_position_acceptance(mlflow_server, tid, ckpt,
                                                                                       tmp_path):
    """version.json's tau_k (the live-acceptance checks' reference): the register step's tag where the
    version has one; a version registered without it (before every version got one) has it rebuilt
    from its run's accepted_per_pos/<i>: τ(0) = 1, τ(1) = 1 + 0.7 (`_log`'s per-position metric)."""
    _, old = _log(mlflow_server, tid, ckpt, 2.0)
    assert json.loads((registry.download_version(mlflow_server, tid, old, tmp_path / "a") / "version.json")
                      .read_text())["tau_k"] == [1.0, 1.7]
    _, new = registry.log_candidate(mlflow_server, tid, ckpt, {}, {"accepted_per_pos/0": 0.7},
                                    {"snapshot_rev": "abc.dir", "tau_k": "[1.0, 1.5, 1.75]"})
    assert json.loads((registry.download_version(mlflow_server, tid, new, tmp_path / "b") / "version.json")
                      .read_text())["tau_k"] == [1.0, 1.5, 1.75]
    assert registry.tau_k({"tau_k": "[1.0, 5.0]"}, {"accepted_per_pos/0": 0.5}) == []  # a bad tag is not patched
    assert registry.tau_k({}, {"accepted_per_pos/0": 0.5, "accepted_per_pos/2": 0.1}) == [1.0, 1.5]
    assert registry.tau_k({}, {"accepted_per_pos/1": 0.25, "accepted_per_pos/0": 0.5}) == [1.0, 1.5, 1.75]
    assert registry.tau_k({}, {"accepted_per_pos/0": 0.5, "accepted_per_pos/1": 0.9}) == []  # no chain accepts so


def test_up_reuses_running_prefect(prefect_server, services_state_dir):
    before = services.status(services_state_dir)["prefect"]
    assert before["healthy"] and before["url"] == prefect_server
    again = services.up(services_state_dir, which=("prefect",))["prefect"]
    assert again.pid == before["pid"] and again.url == prefect_server
    assert services.env_for({"prefect": again}) == {"PREFECT_API_URL": prefect_server}


def test_missing_deployments_names_what_prefect_deploy_would_create(prefect_server, tmp_path):
    """`tidespec services up`'s next step: the deployments prefect.yaml declares that the server lacks,
    in the file's order (names of this test's own). One on the server with the same name and
    entrypoint is there; a namesake running another entrypoint is not; no deployment declared: None
    (test_serve_loop checks the shipped prefect.yaml after `prefect deploy`)."""
    from tidespec.adapters import orchestrate
    tag = uuid.uuid4().hex[:8]
    entry = "flows/x.py:f"

    async def create(c):
        await c.create_deployment(flow_id=await c.create_flow_from_name(f"f-{tag}"), name=f"there-{tag}",
                                  entrypoint=entry)
        await c.create_deployment(flow_id=await c.create_flow_from_name(f"other-{tag}"), name=f"namesake-{tag}",
                                  entrypoint="elsewhere.py:g")
    orchestrate._call(prefect_server, create)
    (tmp_path / "prefect.yaml").write_text(json.dumps({"deployments": [
        {"name": f"b-{tag}", "entrypoint": entry}, {"name": f"there-{tag}", "entrypoint": entry},
        {"name": f"namesake-{tag}", "entrypoint": entry}, {"name": f"a-{tag}", "entrypoint": entry}]}))
    assert orchestrate.missing_deployments(prefect_server, tmp_path) == [f"b-{tag}", f"namesake-{tag}", f"a-{tag}"]
    for doc in ({"deployments": []}, {"deployments": None}, {}):
        (tmp_path / "prefect.yaml").write_text(json.dumps(doc))
        assert orchestrate.missing_deployments(prefect_server, tmp_path) is None


def test_up_idempotent_then_down_stops(tmp_path, mlflow_server, services_state_dir):
    sd = tmp_path / "svc"
    # seed with the session server's already-migrated db: a fresh one costs ~10 s of migrations
    (sd / "mlflow").mkdir(parents=True)
    with sqlite3.connect(services_state_dir / "mlflow" / "mlflow.db") as src, \
            sqlite3.connect(sd / "mlflow" / "mlflow.db") as dst:
        src.backup(dst)
    a = services.up(sd, which=("mlflow",))["mlflow"]
    try:
        b = services.up(sd, which=("mlflow",))["mlflow"]
        assert (a.pid, a.url) == (b.pid, b.url)
        assert services.env_for({"mlflow": b}) == {"MLFLOW_TRACKING_URI": b.url}
        assert services.status(sd)["mlflow"]["healthy"]
        # the main process dies, its uvicorn child keeps serving: down still stops the whole group
        children = psutil.Process(a.pid).children(recursive=True)
        psutil.Process(a.pid).kill()
        psutil.Process(a.pid).wait(10) if process.child(a.pid) is None else process.child(a.pid).wait(10)
        assert services.status(sd)["mlflow"]["alive"] is False
    finally:
        assert services.down(sd, which=("mlflow",)) == ["mlflow"]
    assert not psutil.pid_exists(a.pid) or psutil.Process(a.pid).status() == psutil.STATUS_ZOMBIE
    assert children and not any(ch.is_running() and ch.status() != psutil.STATUS_ZOMBIE for ch in children)
    assert not process.http_ok(f"{a.url}/health")
    assert services.status(sd) == {} and not (sd / "mlflow.json").exists()
    assert services.down(sd) == []


def test_caller_killed_while_a_server_starts_leaves_it_recorded(tmp_path, mlflow_server, services_state_dir):
    """`up` SIGKILLed before its server is healthy: the server is on record, so the next `up`
    adopts it (no second server, no orphan) and `down` stops it."""
    import subprocess
    import sys
    import time

    sd = tmp_path / "svc"
    (sd / "mlflow").mkdir(parents=True)
    with sqlite3.connect(services_state_dir / "mlflow" / "mlflow.db") as src, \
            sqlite3.connect(sd / "mlflow" / "mlflow.db") as dst:
        src.backup(dst)
    code = f"from tidespec.adapters import services; services.up({str(sd)!r}, which=('mlflow',))"
    caller = subprocess.Popen([sys.executable, "-c", code])
    state, deadline, server = sd / "mlflow.json", time.monotonic() + 60, None
    try:
        while server is None and time.monotonic() < deadline and caller.poll() is None:
            rec = json.loads(state.read_text()) if state.exists() else {}  # written by a rename: whole or absent
            kids = {p.pid: p for p in psutil.Process(caller.pid).children()}
            server = kids.get(rec.get("pid"))
            time.sleep(0.02)
        assert server is not None, "the caller never recorded a launched mlflow"
        caller.kill()
        caller.wait(10)
        assert not process.http_ok(f"{rec['url']}/health")  # killed while its server was still starting
        again = services.up(sd, which=("mlflow",))["mlflow"]
        assert again.pid == server.pid and process.http_ok(f"{again.url}/health")
    finally:
        caller.kill()
        assert services.down(sd, which=("mlflow",)) == ["mlflow"]
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE


def test_poll_until_returns_the_value_or_names_what_it_waited_for(tmp_path):
    """`process.poll_until` (the demos' and the tests' wait): the first truthy value; on timeout or an
    exited process, the given error naming what it waited for, the exit code and the log's tail."""
    import subprocess
    import sys

    from tidespec.adapters.process import ProcessError, poll_until
    calls = iter([None, 0, "", {"v": 1}])
    assert poll_until(lambda: next(calls), 5, "x", poll_s=0.01) == {"v": 1}
    with pytest.raises(ProcessError, match="timed out after 0.05 s waiting for the moon"):
        poll_until(lambda: None, 0.05, "the moon", poll_s=0.01)
    log = tmp_path / "s.log"
    log.write_text("a\nlast words\n")
    p = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    p.wait()
    with pytest.raises(RuntimeError, match=r"server exited \(3\) while waiting for health(.|\n)*last words"):
        poll_until(lambda: None, 5, "health", p, log, error=RuntimeError)


def test_a_server_that_loses_its_port_before_binding_is_relaunched_on_a_fresh_one(tmp_path):
    """The CI failure this guards: Prefect picked a free port, migrated its database for seconds,
    then could not bind (another process had taken the port: uvicorn exit 3). `_start` relaunches
    such a server on a fresh port; a server failing for another reason is not relaunched."""
    import socket

    sd = (tmp_path / "svc").resolve()
    held = socket.socket()
    held.bind((services.HOST, 0))  # taken, as the source port of a connection would take it
    held.listen()
    taken = held.getsockname()[1]
    calls: list[int] = []

    def launch_moto():
        calls.append(1)
        return services._launch_moto(sd, taken if len(calls) == 1 else None)  # None: _pick_port, fresh

    out: dict = {}
    try:
        services._start(sd, [launch_moto], out, timeout_s=60)
        assert len(calls) == 2 and out["moto"].url != f"http://{services.HOST}:{taken}"
        assert process.http_ok(services._health_url(out["moto"].url, "moto"))
        assert process.lost_port_race(out["moto"].log)  # the first launch's words are kept in the log
        assert json.loads((sd / "moto.json").read_text())["pid"] == out["moto"].pid
    finally:
        held.close()
        services.down(sd)

    def launch_broken():  # exits at once for another reason: one launch, the error names its log
        calls.append(1)
        return services._launch("moto", [sys.executable, "-c", "raise SystemExit('bad flag')"], {}, sd,
                                f"http://{services.HOST}:1", 1)

    calls.clear()
    with pytest.raises(services.ServiceError, match=r"moto server exited with 1(.|\n)*bad flag"):
        services._start(sd, [launch_broken], {}, timeout_s=30)
    assert len(calls) == 1 and not (sd / "moto.json").exists()


def test_free_port_is_below_the_ephemeral_range():
    """Outbound connections take their source ports from the ephemeral range: a port picked below it
    cannot be lost to one of them between the pick and the server's bind."""
    low = process._ephemeral_low()
    ports = {process.free_port(services.HOST) for _ in range(20)}
    assert all(process._PICK_FROM <= p < low for p in ports) and len(ports) > 1


def test_stop_kills_a_process_whose_main_thread_exited_while_others_run(tmp_path):
    """A server whose main thread has exited while another thread runs shows as a zombie in /proc
    but lives on (a vLLM API server waiting for keep-alive connections did this). `stop` must still
    see it alive and kill it; it used to return at once and leave it running."""
    import time
    code = ("import ctypes, threading, time; threading.Thread(target=time.sleep, args=(120,)).start(); "
            "ctypes.CDLL(None).pthread_exit(None)")
    proc = process.launch([sys.executable, "-c", code], tmp_path / "log")
    process.poll_until(lambda: psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE, 30, "the main thread to exit")
    assert proc.poll() is None and process.group_alive(proc.pid)  # a zombie leader, the process alive
    t0 = time.monotonic()
    process.stop(proc.pid, grace_s=1.0)
    assert proc.poll() is not None and not process.group_alive(proc.pid)
    assert time.monotonic() - t0 < 10  # SIGTERM ends it (the default action), no need to wait the 120 s


def test_a_candidate_that_forgets_a_class_beyond_max_forgetting_is_not_promoted(mlflow_server, tid, ckpt):
    """`max_forgetting`: a τ gain on the window does not promote a candidate that loses more than that
    share on a class's retained holdout; at or under it, or with the check off (None), it does."""
    uri = mlflow_server
    _, v1 = _log(uri, tid, ckpt, 2.0)
    registry.promote_if_better(uri, tid, v1, 2.0, None, 0.02, True)
    _, v2 = _log(uri, tid, ckpt, 2.5)
    d = registry.promote_if_better(uri, tid, v2, 2.5, 2.0, 0.02, True, forgetting={"chat": 0.05, "math": 0.01},
                                   max_forgetting=0.02)
    assert not d.promoted and d.reason.endswith("but it forgets chat (5.0% > 2.0% on its retained holdout)")
    assert registry.champion(uri, tid).version == v1
    assert registry.promote_if_better(uri, tid, v2, 2.5, 2.0, 0.02, True, forgetting={"chat": 0.05},
                                      max_forgetting=None).promoted  # reported, not gated
    _, v3 = _log(uri, tid, ckpt, 2.6)
    assert registry.promote_if_better(uri, tid, v3, 2.6, 2.5, 0.02, True, forgetting={"chat": 0.02},
                                      max_forgetting=0.02).promoted  # at the bound
