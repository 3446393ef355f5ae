"""`tidespec serve --capture` closes the loop by itself, on real servers (Prefect server + process
worker, MLflow): the server process captures its traffic → the writer seals at
capture.seal_min_tokens → the seal is published (DVC add + push, the tidespec.capture.threshold
event) → the `tide-cycle` deployment's trigger runs the cycle on the worker → a promoted champion
deployed to data/drafts/champion → the running server serves it. No hand step between the
requests and the new draft."""
from __future__ import annotations

import os
import re

import httpx
import pytest
import yaml

from conftest import copy_prefect_project, first_champion, health, published_rev, serving, tiny_params_yaml, wait_until

pytestmark = pytest.mark.services


def test_serve_capture_publishes_and_serves_the_promoted_champion(tmp_path, tiny_target_dir, prefect_server,
                                                                  prefect_worker, mlflow_server):
    from tidespec.adapters import orchestrate, registry
    from tidespec.config import load_params
    from tidespec.models.load import get_target

    proj = copy_prefect_project(tmp_path / "proj")  # prefect.yaml + the flows/ its entrypoints name
    raw = yaml.safe_load(tiny_params_yaml(tiny_target_dir))
    raw["capture"] |= {"seal_min_tokens": 300}  # 12 requests × (8 prompt + 24 new) tokens = 384: one seal
    raw["serve"] = {"watch_champion_s": 0.5}
    raw["engine"]["adaptive"] = False  # fixed k: no calibration at start
    (proj / "params.yaml").write_text(yaml.safe_dump(raw))
    params = load_params(proj / "params.yaml")
    target = get_target(params)[0]
    tid = target.target_id
    ws, v1 = first_champion(proj, params, target, mlflow_server, prefect_server, tmp_path)
    assert orchestrate.missing_deployments(prefect_server, proj) == []  # `services up` says so, not "deploy"

    env = os.environ | {"PREFECT_API_URL": prefect_server, "MLFLOW_TRACKING_URI": mlflow_server}
    with serving(proj, tmp_path, env) as (url, proc):
        assert wait_until(lambda: health(url), 180, "/health", proc)["draft_version"] == v1
        import torch
        g = torch.Generator().manual_seed(0)
        for _ in range(12):  # a learnable workload: prompt ids in a small range (the draft vocab covers them)
            prompt = torch.randint(3, 60, (8,), generator=g).tolist()
            r = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 24, "ignore_eos": True},
                           timeout=120)
            assert r.status_code == 200, r.text
        snaps = ws.snapshots / tid
        dvcs = wait_until(lambda: sorted(snaps.glob("*.dvc")) if snaps.is_dir() else [], 120, "a published snapshot",
                     proc)
        assert len(dvcs) == 1  # sealed by the server's writer and DVC-tracked by its publisher

        rev = wait_until(lambda: published_rev(proj, snaps / dvcs[0].stem), 60, "a complete .dvc file", proc)
        run = orchestrate.wait_for_run(prefect_server, orchestrate.CYCLE_DEPLOYMENT, {"snapshot_rev": rev}, 600)
        assert run.state.is_completed(), run.state
        assert run.parameters["target_id"] == tid and run.parameters["trigger"] == "tokens"  # from the event
        champ = registry.champion(mlflow_server, tid)
        assert champ.version != v1 and champ.tags["snapshot_rev"] == rev
        h = wait_until(lambda: (h := health(url)) and h["draft_version"] == champ.version and h, 60,
                  f"the server to serve v{champ.version}", proc)
        assert h["draft_version"] == champ.version
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4}, timeout=60)
        assert r.json()["tidespec"]["draft_version"] == champ.version
        metrics, rid = httpx.get(f"{url}/metrics", timeout=10).text, h["replica_id"]  # on every series
        assert f'tidespec:draft_info{{replica_id="{rid}",version="{champ.version}"}} 1.0' in metrics
        assert f'tidespec:capture_publish_errors_total{{replica_id="{rid}"}} 0.0' in metrics
    out = (tmp_path / "serve.log").read_text()
    k = params.engine.num_draft_tokens  # the start line: what is served, before the first request
    assert re.search(rf"serve: model '[^']+': target {tid[:12]} \(fp32 on cpu\), draft v{v1}; proposers "
                     rf"\S*eagle3\S*, k = {k}\n", out), out
