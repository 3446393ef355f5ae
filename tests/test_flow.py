"""The Prefect flow tide_cycle against a real Prefect server and MLflow server, on a tiny target."""
import pytest

from conftest import make_tiny_workspace

pytestmark = pytest.mark.services


def test_tide_cycle_flow_registers_champion(tmp_path, tiny_target_dir, prefect_server, mlflow_server):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tidespec import registry
    from tidespec.demo import load_flow
    from tidespec.deploy.local import served_version

    ws, params, target = make_tiny_workspace(tmp_path, tiny_target_dir)
    flow = load_flow(tmp_path)
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
