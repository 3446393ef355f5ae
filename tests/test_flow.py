"""The Prefect flow tide_cycle against a real Prefect server and MLflow server, on a tiny target; the
flow is loaded from the project's flows/cycle.py as a worker loads it (`orchestrate.load_flow`)."""
from pathlib import Path

import pytest

from conftest import make_tiny_workspace

pytestmark = pytest.mark.services
REPO = Path(__file__).resolve().parents[1]


def test_tide_cycle_flow_registers_champion(tmp_path, tiny_target_dir, prefect_server, mlflow_server):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tidespec.adapters import orchestrate, registry
    from tidespec.workspace import served_version

    flow = orchestrate.load_flow("tide_cycle", REPO)

    ws, params, target = make_tiny_workspace(tmp_path, tiny_target_dir)
    with temporary_settings({PREFECT_API_URL: prefect_server}):
        res = flow(root=str(tmp_path), params_path=str(tmp_path / "params.yaml"), target_id=target.target_id,
                   snapshot_rev="test-rev", tracking_uri=mlflow_server)

        async def runs():
            async with get_client() as c:
                return await c.read_flow_runs()
        import asyncio
        flow_runs = asyncio.run(runs())
    assert any(r.name and r.state.is_completed() for r in flow_runs)
    rep = res["evaluate"]
    assert rep["lossless"] is True and rep["candidate"]["mismatches"] == 0
    assert rep["candidate"]["num_drafts"] > 0 and rep["candidate"]["new_tokens"] == rep["baseline"]["new_tokens"]
    dec = res["register"]
    assert dec["promoted"] is True  # no champion yet
    info = registry.champion(mlflow_server, target.target_id)
    assert info is not None and info.version == dec["version"]
    assert info.tags["snapshot_rev"] == "test-rev" and info.tags["params_sha"] == params.sha()
    assert served_version(ws.champion) == dec["version"]  # deployed locally
    # MLflow: per-workload τ, per-position acceptance, loss curve, lineage, PNG plots
    from mlflow import MlflowClient
    c = MlflowClient(mlflow_server)
    run = c.get_run(dec["run_id"])
    m = run.data.metrics
    assert m["acceptance_length/code"] == pytest.approx(rep["candidate"]["acceptance_length"])  # one workload
    assert m["accepted_per_pos/0"] == pytest.approx(rep["candidate"]["accepted_per_pos/0"])
    from tidespec.engine.stats import tau_standard_error
    per = [rep["candidate"][f"accepted_per_pos/{i}"] for i in range(params.engine.num_draft_tokens)]
    assert m["tau_se/code"] == pytest.approx(tau_standard_error(per, rep["candidate"]["num_drafts"]))
    losses = [x.value for x in c.get_metric_history(dec["run_id"], "train/loss")]
    import json
    logged = json.loads((ws.candidate / "train_metrics.json").read_text())["train/loss"]
    assert losses == pytest.approx(logged) and len(losses) == 2  # one point per epoch (2 epochs)
    assert run.data.tags["trigger"] == "manual" and run.data.tags["target_id"] == target.target_id
    pngs = sorted(a.path for a in c.list_artifacts(dec["run_id"], "plots"))
    assert pngs == ["plots/per_position_acceptance.png", "plots/tau_over_cycles.png", "plots/train_loss.png"]
    png = c.download_artifacts(dec["run_id"], "plots/tau_over_cycles.png", str(tmp_path))
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert run.data.tags["decision"] == "promoted"
    # a scheduled run with no new snapshot is skipped (champion untouched); force retrains
    with temporary_settings({PREFECT_API_URL: prefect_server}):
        again = flow(root=str(tmp_path), params_path=str(tmp_path / "params.yaml"), target_id=target.target_id,
                     tracking_uri=mlflow_server, trigger="schedule")
    assert "no snapshot newer" in again["skipped"]
    assert registry.champion(mlflow_server, target.target_id).version == dec["version"]
    # lineage on the event route: the event's rev + every curated snapshot's rev
    (sid,) = [p.name for p in (ws.snapshots / target.target_id).iterdir() if p.is_dir()]
    assert list(json.loads(info.tags["snapshot_revs"])) == [sid]
    assert json.loads(info.tags["snapshot_revs"])[sid].startswith("untracked:")  # no DVC in this workspace
    # the schedule route (no event payload) records lineage too: the newest window snapshot's rev
    with temporary_settings({PREFECT_API_URL: prefect_server}):
        forced = flow(root=str(tmp_path), params_path=str(tmp_path / "params.yaml"), target_id=target.target_id,
                      tracking_uri=mlflow_server, trigger="schedule", force=True)
    mv = c.get_model_version(registry.model_name(target.target_id), forced["register"]["version"])
    assert mv.tags["snapshot_rev"] == json.loads(info.tags["snapshot_revs"])[sid] != ""
    assert mv.tags["snapshot_revs"] == info.tags["snapshot_revs"] and mv.tags["params_sha"] == params.sha()


def test_params_are_read_once_per_cycle(tmp_path, tiny_target_dir, prefect_server, mlflow_server, monkeypatch):
    """params.yaml edited while a cycle runs (here between its curate and train tasks): the cycle
    keeps the params it started with — training, evaluation, registration and deploy read one frozen
    copy (data/work/params-<sha>.yaml) — so the registered params_sha is that of the params training
    used, not of the edited file."""
    from mlflow import MlflowClient
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tidespec.adapters import orchestrate, registry
    from tidespec.config import load_params
    from tidespec.steps import cycle

    ws, params, target = make_tiny_workspace(tmp_path, tiny_target_dir)
    pp = tmp_path / "params.yaml"
    real_curate, real_train, used = cycle.step_curate, cycle.train_candidate, {}

    def curate_then_edit(ws_, p, target_id):
        out = real_curate(ws_, p, target_id)
        pp.write_text(pp.read_text().replace("min_relative_gain: 0.0", "min_relative_gain: 0.5")
                      .replace("epochs: 2", "epochs: 1"))  # someone tunes the next cycle meanwhile
        return out

    def train(ws_, p, *a, **kw):
        used["sha"], used["epochs"], used["params_path"] = p.sha(), p.train.epochs, kw.get("params_path")
        return real_train(ws_, p, *a, **kw)
    monkeypatch.setattr(cycle, "step_curate", curate_then_edit)
    monkeypatch.setattr(cycle, "train_candidate", train)
    flow = orchestrate.load_flow("tide_cycle", REPO)
    with temporary_settings({PREFECT_API_URL: prefect_server}):
        res = flow(root=str(tmp_path), params_path=str(pp), target_id=target.target_id, tracking_uri=mlflow_server)
    edited = load_params(pp)
    assert edited.sha() != params.sha() and edited.train.epochs == 1  # the edit happened, mid-cycle
    assert used["sha"] == params.sha() and used["epochs"] == 2  # training used the params the cycle started with
    assert Path(used["params_path"]) == ws.work / f"params-{params.sha()}.yaml"  # the frozen copy (a pool reads it)
    c = MlflowClient(mlflow_server)
    mv = c.get_model_version(registry.model_name(target.target_id), res["register"]["version"])
    assert mv.tags["params_sha"] == used["sha"]  # lineage names the params training used
    logged = c.get_run(res["register"]["run_id"]).data.params  # and the run logged those params, not the edit
    assert logged["train.epochs"] == "2" and logged["evaluate.min_relative_gain"] == "0.0"
