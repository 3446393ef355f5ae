"""The loop closes around a real vLLM, on real servers (Prefect server + process worker, MLflow):
`tidespec serve --backend vllm` starts vLLM with the champion as its EAGLE3 draft behind the front
door → its traffic is text-captured → past capture.seal_min_tokens the front door emits
tidespec.capture.text → the `tide-capture` deployment's trigger ingests it (the hidden states
rehydrated by a second vLLM, `ingest.rehydrate_backend: vllm`) → the seal is published (DVC + the
tidespec.capture.threshold event) → `tide-cycle` on
the worker trains, evaluates and promotes → the serving command loads the new champion into the
running vLLM (in place: the same server) → vLLM's own counters, read through the front door's
/metrics, give τ before and after (after: less the counts at the swap).
No hand step between the requests and the new draft."""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import yaml

from conftest import (
    copy_prefect_project,
    health,
    make_vllm_tiny_target,
    published_rev,
    random_draft,
    shipped_params,
    vllm_python_or_skip,
    wait_until,
)

pytestmark = pytest.mark.services


def _counters(url: str):
    from tidespec.backends.vllm import parse_metrics
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


def _live_tau(uri: str, tid: str, version: str) -> float | None:
    from mlflow import MlflowClient

    from tidespec.adapters import registry
    c = MlflowClient(uri)
    run_id = c.get_model_version(registry.model_name(tid), version).run_id
    return c.get_run(run_id).data.metrics.get("live/acceptance_length")


def _traffic(url: str, seed: int, n: int = 12) -> None:
    import torch
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):  # word-tokenizer text: a learnable workload in a small id range
        words = " ".join(f"t{i}" for i in torch.randint(6, 60, (8,), generator=g).tolist())
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": words, "max_tokens": 24,
                                                      "temperature": 0, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text


def test_serve_vllm_traffic_trains_the_draft_vllm_then_serves(tmp_path, prefect_server, prefect_worker,
                                                               mlflow_server):
    python = vllm_python_or_skip()
    from tidespec.adapters import orchestrate, registry, versioning
    from tidespec.adapters.services import free_port
    from tidespec.config import load_params
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.models.load import get_target
    from tidespec.steps.cycle import step_deploy
    from tidespec.workspace import Workspace

    tdir = make_vllm_tiny_target(tmp_path / "target")
    proj = copy_prefect_project(tmp_path / "proj")
    raw = shipped_params(tdir)  # its serve section as shipped: every default written out (make demo-vllm's)
    # capture.mode as shipped (hidden): a front door captures text anyway; 12 × (9 + 24) tokens: one seal
    raw["capture"] |= {"seal_min_tokens": 300}
    raw["serve"] |= {"watch_champion_s": 0.5, "served_model_name": "tiny", "live_stats_s": 1.0}
    raw["engine"]["adaptive"] = False
    raw["ingest"] |= {"rehydrate_backend": "vllm", "rehydrate_batch": 4}  # tide-capture's prefill: vLLM's extraction
    raw["deploy"] = {"sagemaker": {"role_arn": "arn:aws:iam::123456789012:role/r", "s3_prefix": "s3://bucket/tidespec",
                                   "profiles": {"gpu": {"engine": "sglang", "instance_type": "ml.g6e.2xlarge"}}}}
    (proj / "params.yaml").write_text(yaml.safe_dump(raw))
    params = load_params(proj / "params.yaml")
    target = get_target(params)[0]
    tid = target.target_id
    versioning.ensure_repo(proj, str(tmp_path / "dvc-remote"))
    _, v1 = registry.log_candidate(mlflow_server, tid, save_checkpoint(random_draft(target, 64, seed=1),
                                                                       tmp_path / "d1"),
                                   params={}, metrics={}, tags={"role": "bootstrap"})
    registry.promote(mlflow_server, tid, v1, "first draft", allow_unevaluated=True)
    ws = Workspace(proj)
    step_deploy(ws, mlflow_server, tid, params)
    orchestrate.deploy(proj, prefect_server)

    url = f"http://127.0.0.1:{free_port()}"
    env = os.environ | {"PREFECT_API_URL": prefect_server, "MLFLOW_TRACKING_URI": mlflow_server}
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "tidespec.cli", "serve", "--backend", "vllm", "--vllm-python",
                             python, "--root", str(proj), "--params", str(proj / "params.yaml"), "--port",
                             url.rsplit(":", 1)[1]], cwd=proj, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        h = wait_until(lambda: health(url), 400, "/health", proc)
        assert h["engine"] == "vllm" and h["draft_version"] == v1
        _traffic(url, seed=0)
        before = _counters(url)  # vLLM's own counters, v1 (random draft)
        assert before is not None and before.num_drafts > 0
        # the serving command logs vLLM's counters to the served version's MLflow run
        wait_until(
            lambda: _live_tau(mlflow_server, tid, v1) == before.acceptance_length, 60, "v1's live τ in MLflow", proc
        )
        # the front door's text log passed capture.seal_min_tokens → tidespec.capture.text → tide-capture
        # ingests (rehydrates, seals, publishes: DVC + tidespec.capture.threshold) → tide-cycle
        snaps = ws.snapshots / tid
        (dvc,) = wait_until(lambda: sorted(snaps.glob("*.dvc")) if snaps.is_dir() else [], 600, "a published snapshot",
                       proc)
        rev = wait_until(lambda: published_rev(proj, snaps / dvc.stem), 60, "a complete .dvc file", proc)
        assert "Application startup complete" in (ws.state / "vllm-extract.log").read_text()  # vLLM rehydrated it
        cyc = orchestrate.wait_for_run(prefect_server, orchestrate.CYCLE_DEPLOYMENT, {"snapshot_rev": rev}, 900)
        assert cyc.state.is_completed(), cyc.state
        champ = registry.champion(mlflow_server, tid)
        assert champ.version != v1 and champ.tags["snapshot_rev"] == rev
        wait_until(lambda: (h := health(url)) and h["draft_version"] == champ.version, 400,
              f"vLLM to serve v{champ.version}", proc)
        assert health(url)["backend"] == h["backend"]  # loaded in place: the same vLLM server
        at_swap = _counters(url)
        # the same workload again, now on the new draft: 7 of the 12 prompts, so the text log stays under
        # capture.seal_min_tokens (≤ 2 exchanges left over from the first 12 + 7, ≤ 33 tokens each, < 300)
        # and no second tide-capture run (a vLLM extraction) outlives the test
        _traffic(url, seed=0, n=7)
        after = _counters(url) - at_swap
        assert after.num_drafts > 0 and after.acceptance_length > before.acceptance_length, (before, after)
        wait_until(lambda: _live_tau(mlflow_server, tid, champ.version) == after.acceptance_length, 60,
              f"v{champ.version}'s live τ in MLflow", proc)
        # the endpoint profiles' windows, tuned again from the per-position acceptance vLLM measured
        from tidespec.steps.tuning import live_windows
        want = {p: str(w["k"]) for p, w in live_windows(params.deploy.sagemaker, after.per_position_rate,
                                                           after.num_drafts).items()}
        assert set(want) == {"gpu", "trn2"}
        wait_until(lambda: {p: registry.version_tags(mlflow_server, tid, champ.version).get(f"live_tuned_k.{p}")
                            for p in want} == want, 60, "the live-tuned windows on the version", proc)
        print(f"vLLM's counters: v{v1} τ {before.acceptance_length:.3f} {before}; "
              f"v{champ.version} τ {after.acceptance_length:.3f} {after}")
    finally:
        proc.terminate()
        proc.wait(120)
        log.close()
    out = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in out, out
