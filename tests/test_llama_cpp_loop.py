"""The loop closes around a real llama.cpp (`make llama-server`), on real servers (Prefect server +
process worker, MLflow): `tidespec serve --backend llama-cpp` serves the target GGUF with the
champion converted to an EAGLE-3 GGUF behind the front door → its traffic is text-captured → past
capture.seal_min_tokens the front door emits tidespec.capture.text → the `tide-capture` deployment
ingests it (the hidden states rehydrated by the embedded target) and publishes the seal (DVC + the
tidespec.capture.threshold event) → `tide-cycle` on the worker trains, evaluates and promotes → the
serving command swaps llama-server to the new champion (blue/green: a fresh server) → llama.cpp's
own counters, read through the front door's /metrics, give τ before and after; every served output
equals llama-server's own plain decoding (no draft) at the same settings.
No hand step between the requests and the new draft. Skipped, naming `make llama-server`, only where
llama-server is not built (`backends.llama_cpp.unavailable_reason`)."""
from __future__ import annotations

import os

import httpx
import pytest

from conftest import (
    copy_prefect_project,
    cycle_served,
    first_champion,
    health,
    live_tau,
    serving,
    shipped_params,
    wait_until,
)

pytestmark = pytest.mark.services

# the served traffic: prompts the target continues the same way each time (greedy), few tokens each
PROMPTS = ["def fibonacci(n):\n", "import json\n\ndef load(path):\n", "class Stack:\n    def __init__(self):\n",
           "def is_prime(n):\n", "for i in range(10):\n", "def read_lines(path):\n",
           "The three primary colours are", "def reverse(s):\n"]
MAX_TOKENS = 24


def _counters(url: str):
    from tidespec.backends.llama_cpp import parse_metrics
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


def _complete(url: str, store: bool | None, model: str | None = "smol") -> list[str]:
    """Each PROMPT completed greedily at `url`, one request at a time (`store`: None leaves it out,
    so the front door captures); the texts."""
    texts = []
    for p in PROMPTS:
        body = {"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        body |= ({"model": model} if model else {}) | ({} if store is None else {"store": store})
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
    return texts


def _plain(params, tmp_path) -> list[str]:
    """PROMPTS decoded by llama-server itself with no draft, at the served settings (slots, context, threads)."""
    from tidespec.backends import llama_cpp
    cfg = llama_cpp.LlamaCppLaunch.from_params(params, draft_path=None, threads=1)
    with llama_cpp.LlamaCppServer(cfg, tmp_path / "plain.log") as srv:
        return _complete(srv.url, store=None, model=None)


def test_serve_llama_cpp_traffic_trains_the_draft_then_llama_cpp_serves_it(tmp_path, prefect_server, prefect_worker,
                                                                           mlflow_server):
    from tidespec.backends import llama_cpp
    reason = llama_cpp.unavailable_reason()
    if reason:
        pytest.skip(f"llama.cpp cannot run here: {reason}")
    import yaml

    from tidespec.assets import cache_dir
    from tidespec.config import load_params
    from tidespec.models.load import get_target

    proj = copy_prefect_project(tmp_path / "proj")
    raw = shipped_params("smollm2")  # llama.cpp serves the shipped target GGUF; the shipped defaults otherwise
    # 8 × (≈ 8 + 24) tokens: one seal; what is served after the swap is sent with store: false (never captured)
    raw["capture"] |= {"seal_min_tokens": 200}
    raw["serve"] |= {"watch_champion_s": 0.5, "served_model_name": "smol", "live_stats_s": 1.0}
    raw["engine"] |= {"adaptive": False, "max_batch": 2}  # llama.cpp's k is fixed: evaluate's replay at that k
    raw["draft"] |= {"draft_vocab_size": 1024}  # SmolLM2's 49152 ids: 64 would cover too little of the traffic
    raw["train"] |= {"epochs": 20, "lr": 3e-3}  # a handful of records: enough steps to learn them
    (proj / "params.yaml").write_text(yaml.safe_dump(raw))
    params = load_params(proj / "params.yaml")
    target = get_target(params)[0]
    tid = target.target_id
    ws, v1 = first_champion(proj, params, target, mlflow_server, prefect_server, tmp_path, vd=1024)
    (proj / ".cache").symlink_to(cache_dir().resolve().parent)  # the worker's flows find the target's wheel there
    with open(proj / ".git" / "info" / "exclude", "a") as f:
        f.write(".cache\n")

    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_")}  # none of llama-server's own settings
    env |= {"PREFECT_API_URL": prefect_server, "MLFLOW_TRACKING_URI": mlflow_server, "OMP_NUM_THREADS": "1"}
    with serving(proj, tmp_path, env, "--backend", "llama-cpp") as (url, proc):
        h = wait_until(lambda: health(url), 300, "/health", proc)
        assert h["engine"] == "llama-cpp" and h["draft_version"] == v1
        served_v1 = _complete(url, store=None)  # captured
        before = _counters(url)  # llama.cpp's own, v1 (a random draft)
        assert before is not None and before.num_drafts > 0
        wait_until(lambda: live_tau(mlflow_server, tid, v1) == before.acceptance_length, 60, "v1's live τ in MLflow",
                   proc)
        # the front door's text log passed capture.seal_min_tokens → tidespec.capture.text → tide-capture
        # ingests (rehydrates, seals, publishes: DVC + tidespec.capture.threshold) → tide-cycle → the swap
        _, champ = cycle_served(proj, ws, tid, v1, prefect_server, mlflow_server, url, proc)
        assert health(url)["backend"] != h["backend"]  # blue/green: another llama-server, its counters from 0
        at_swap = _counters(url)  # green's canary among them
        served_v2 = _complete(url, store=False)
        served = _counters(url)  # the new server's since its start: v2's live figures
        after = served - at_swap
        assert after.num_drafts > 0 and after.acceptance_length > before.acceptance_length, (before, after)
        wait_until(lambda: live_tau(mlflow_server, tid, champ.version) == served.acceptance_length, 60,
                   f"v{champ.version}'s live τ in MLflow", proc)
    plain = _plain(params, tmp_path)  # after serve stopped: the two cores to itself
    assert served_v1 == plain and served_v2 == plain
    print(f"llama.cpp's counters: v{v1} τ {before.acceptance_length:.3f} {before}; "
          f"v{champ.version} τ {after.acceptance_length:.3f} {after}")
