"""The llama.cpp adapter without a server: the launch line, the counters parsed from llama.cpp's own
exposition, the converted draft's cache key and the requests refused before llama.cpp sees them.
The build: tests/test_llama_cpp_build.py; the real server: tests/test_llama_cpp_real.py."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tidespec.backends import llama_cpp

# llama-server's /metrics after three EAGLE-3 requests at k = 4 (b11312, trimmed: other series and HELP lines)
EXPOSITION = """\
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 39
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 528
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 46
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 133
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 32
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 12
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 2
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="3"} 0
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
"""


def test_counters_parse_into_the_vllm_backends_type():
    c = llama_cpp.parse_metrics(EXPOSITION)
    assert c == llama_cpp.SpecDecodeCounters(133, 528, 46, (32, 12, 2, 0))
    assert c.acceptance_length == pytest.approx(1 + 46 / 133)
    assert c.per_position_rate[0] == pytest.approx(32 / 133)
    assert llama_cpp.parse_metrics("# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 0\n") \
        is None  # no counters exported: live τ unknown, never 0


def test_a_draft_speculates_only_with_spec_type_draft_eagle3(tmp_path):
    cfg = llama_cpp.LlamaCppLaunch("/t.gguf", draft_path="/d.gguf", num_speculative_tokens=5, port=9000, parallel=3,
                                   ctx_per_slot=1024, threads=2, home=str(tmp_path), alias="m")
    a = llama_cpp.launch_args(cfg)
    assert a[0] == str(tmp_path / "bin" / "llama-server")
    joined = " ".join(a)
    for part in ("-m /t.gguf", "-md /d.gguf", "--spec-type draft-eagle3", "--spec-draft-n-max 5", "-np 3",
                 "-c 3072", "--metrics", "-t 2", "--alias m", "--host 127.0.0.1 --port 9000"):
        assert part in joined
    plain = llama_cpp.launch_args(llama_cpp.LlamaCppLaunch("/t.gguf", port=9000, home=str(tmp_path)))
    assert "-md" not in plain and "--spec-type" not in plain
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        llama_cpp.LlamaCppLaunch("/t.gguf", num_speculative_tokens=0)


def test_the_converted_draft_is_keyed_by_its_content(tmp_path):
    draft, target = tmp_path / "b" / "draft", tmp_path / "t"
    draft.mkdir(parents=True)
    target.mkdir()
    (draft / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [2, 15, 27]}))
    (draft / "model.safetensors").write_bytes(b"w")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (target / f).write_text("{}")
    key = llama_cpp.draft_key(tmp_path / "b", target)
    assert key == llama_cpp.draft_key(draft, target) and len(key) == 20  # a bundle or its draft/
    assert llama_cpp.draft_key(draft, target, "f16") != key
    (draft / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [27, 15, 2]}))
    assert llama_cpp.draft_key(draft, target) != key
    (target / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        llama_cpp.draft_key(draft, target)


def test_the_front_door_refuses_what_llama_cpp_would_fail_or_ignore():
    from fastapi.testclient import TestClient

    from tidespec.serve.frontdoor import build_frontdoor
    refuse = llama_cpp.request_refusal
    assert refuse({"prompt": "x", "n": 1}) is None and refuse({"prompt": "x"}) is None
    assert refuse({"n": 3})[0] == "n" and "send 3 requests with n = 1" in refuse({"n": 3})[1]
    assert refuse({"n_cmpl": 2})[0] == "n_cmpl"
    assert refuse({"speculative.n_max": 8})[0] == "speculative.n_max"
    with TestClient(build_frontdoor("http://127.0.0.1:9", refuse=refuse)) as c:  # nothing listens there
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 502  # forwarded


def test_a_new_champion_goes_in_blue_green_and_a_failed_green_leaves_blue_serving(tmp_path, monkeypatch):
    """`LlamaCppDeployment.install` without a real server (tests/test_llama_cpp_real.py runs one): green
    starts with the new draft converted, the front door switches, blue drains and stops; a green that
    fails (here its canary) is stopped and the served version stays."""
    from tidespec.backends.llama_cpp import deployment
    from tidespec.workspace import write_version
    started, stopped, failing = [], [], set()

    class Server:
        def __init__(self, cfg, log_path, ready_timeout_s):
            self.cfg, self.url, self.server = cfg, cfg.url, SimpleNamespace(proc=None)  # no process: 0 MiB

        def start(self):
            started.append(self.cfg)
            return self

        def stop(self):
            stopped.append(self.url)

    class Proxy:
        base = None

        def switch(self, url):
            old, self.base = self.base, url
            return old

        def inflight(self, url):
            return 0

    def canary(url, model, error):
        if url in failing:
            raise error(f"canary to {url} answered 500")
    monkeypatch.setattr(deployment, "LlamaCppServer", Server)
    monkeypatch.setattr(deployment, "draft_gguf", lambda draft, hf, cache: tmp_path / f"{draft.name}.gguf")
    monkeypatch.setattr(deployment, "canary", canary)

    def bundle(version: str) -> Path:
        b = tmp_path / f"b{version}"
        (b / "draft").mkdir(parents=True)
        (b / "draft" / "config.json").write_text("{}")
        (b / "draft" / "model.safetensors").write_bytes(b"w")
        write_version(b, version, f"run-{version}")
        return b
    launch = llama_cpp.LlamaCppLaunch("/t.gguf", port=9001, home=str(tmp_path))
    dep = deployment.LlamaCppDeployment(launch, tmp_path / "state", tmp_path / "hf", proxy=Proxy()).start(bundle("1"))
    dep.proxy.base = dep.url
    assert dep.draft_version == "1" and started[0].draft_path == str(tmp_path / "1-v1.gguf")
    res = dep.install(bundle("2"))
    assert res["mode"] == "blue_green" and res["draft_version"] == "2" and res["drained"]
    assert dep.draft_version == "2" and dep.proxy.base == dep.url != "http://127.0.0.1:9001"
    assert stopped == ["http://127.0.0.1:9001"] and started[1].draft_path == str(tmp_path / "2-v2.gguf")
    monkeypatch.setattr(deployment.process, "free_port", lambda host: 9003)
    failing.add("http://127.0.0.1:9003")
    with pytest.raises(llama_cpp.LlamaCppError, match="canary"):
        dep.install(bundle("3"))
    assert dep.draft_version == "2" and dep.proxy.base == dep.url and stopped[-1] == "http://127.0.0.1:9003"


def test_demo_llama_cpp_is_one_demo_its_engine_keeps_the_keys_llama_server_would_read(tmp_path, monkeypatch):
    """`tidespec demo --llama-cpp` is refused beside another demo flag (naming both) and refused,
    naming `make llama-server`, where the server is not built; its serve command gets neither the
    front door's key nor llama-server's own settings."""
    from typer.testing import CliRunner

    from tidespec.cli import app
    from tidespec.config.serve_launch import LLAMA_ENV
    from tidespec.demos import llama_cpp as demo
    from tidespec.demos.served import ServedEngine
    r = CliRunner().invoke(app, ["demo", "--vllm", "--llama-cpp", "--root", str(tmp_path)])
    assert r.exit_code == 2 and "--vllm and --llama-cpp" in r.output, r.output
    monkeypatch.setenv(llama_cpp.ENV_HOME, str(tmp_path / "none"))
    with pytest.raises(llama_cpp.LlamaCppUnavailable, match="make llama-server"):
        demo.run_demo_llama_cpp(tmp_path, tmp_path / "params.yaml")
    engine = ServedEngine("llama-cpp", "llama.cpp", (), llama_cpp.scrape, "blue/green", unset=LLAMA_ENV)
    kept = [k for k in ("TIDESPEC_API_KEY", "LLAMA_API_KEY", "LLAMA_ARG_THREADS", "LLAMA_APIKEY", "PATH")
            if engine.keeps(k)]
    assert kept == ["LLAMA_APIKEY", "PATH"]
