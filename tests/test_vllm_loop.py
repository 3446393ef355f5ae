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

import httpx
import pytest
import yaml

from conftest import (
    copy_prefect_project,
    cycle_served,
    first_champion,
    health,
    live_tau,
    make_vllm_tiny_target,
    serving,
    shipped_params,
    vllm_python_or_skip,
    wait_until,
)

pytestmark = pytest.mark.services


def _counters(url: str):
    from tidespec.backends.vllm import parse_metrics
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


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
    from tidespec.adapters import registry
    from tidespec.config import load_params
    from tidespec.models.load import get_target

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
    ws, v1 = first_champion(proj, params, target, mlflow_server, prefect_server, tmp_path)

    env = os.environ | {"PREFECT_API_URL": prefect_server, "MLFLOW_TRACKING_URI": mlflow_server}
    with serving(proj, tmp_path, env, "--backend", "vllm", "--vllm-python", python) as (url, proc):
        h = wait_until(lambda: health(url), 400, "/health", proc)
        assert h["engine"] == "vllm" and h["draft_version"] == v1
        _traffic(url, seed=0)
        before = _counters(url)  # vLLM's own counters, v1 (random draft)
        assert before is not None and before.num_drafts > 0
        # the serving command logs vLLM's counters to the served version's MLflow run
        wait_until(
            lambda: live_tau(mlflow_server, tid, v1) == before.acceptance_length, 60, "v1's live τ in MLflow", proc
        )
        # the front door's text log passed capture.seal_min_tokens → tidespec.capture.text → tide-capture
        # ingests (rehydrates, seals, publishes: DVC + tidespec.capture.threshold) → tide-cycle → vLLM serves it
        _, champ = cycle_served(proj, ws, tid, v1, prefect_server, mlflow_server, url, proc, 400)
        assert "Application startup complete" in (ws.state / "vllm-extract.log").read_text()  # vLLM rehydrated it
        assert health(url)["backend"] == h["backend"]  # loaded in place: the same vLLM server
        at_swap = _counters(url)
        # the same workload again, now on the new draft: 7 of the 12 prompts, so the text log stays under
        # capture.seal_min_tokens (≤ 2 exchanges left over from the first 12 + 7, ≤ 33 tokens each, < 300)
        # and no second tide-capture run (a vLLM extraction) outlives the test
        _traffic(url, seed=0, n=7)
        after = _counters(url) - at_swap
        assert after.num_drafts > 0 and after.acceptance_length > before.acceptance_length, (before, after)
        wait_until(lambda: live_tau(mlflow_server, tid, champ.version) == after.acceptance_length, 60,
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
