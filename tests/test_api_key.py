"""The API key of the OpenAI routes (`serve.auth`, `tidespec serve --api-key`, `$TIDESPEC_API_KEY`),
as vLLM's `--api-key`: real servers (`tidespec serve` started as a user starts it, the embedded
engine and the front door before an embedded server standing in for SGLang). Without the key, or
with a wrong one, 401 in OpenAI's envelope with `WWW-Authenticate: Bearer`, streamed routes
included; with it, 200; /health and /metrics open unless `serve.auth_health_metrics`; /admin stays
on its own token. The launch checks refuse a key that cannot work, naming the fix."""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest
import yaml
from fastapi.testclient import TestClient

from conftest import REPO, tiny_params_yaml, wait_until
from tidespec.config import EngineParams, ServeParams, load_params
from tidespec.config.serve_launch import ServeLaunch

KEY, ADMIN = "sk-fleet-1", "admin-2"
COMPLETION = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def refused(r: httpx.Response, given: bool) -> None:
    """`r` is the key's 401: OpenAI's envelope, the challenge header, a message saying what was wrong."""
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key")
    assert ("incorrect" if given else "missing API key") in err["message"]


def check_openai_routes(c, key: str = KEY) -> None:
    """/v1 of client `c` (httpx or TestClient): 401 without the key and with a wrong one, streamed or
    not; 200 with it."""
    refused(c.get("/v1/models"), given=False)
    refused(c.post("/v1/completions", json=COMPLETION), given=False)
    refused(c.post("/v1/completions", json=COMPLETION, headers=bearer("sk-wrong")), given=True)
    refused(c.post("/v1/completions", json=COMPLETION, headers={"Authorization": key}), given=True)  # no scheme
    with c.stream("POST", "/v1/completions", json=COMPLETION | {"stream": True}) as s:
        s.read()
        refused(s, given=False)
    assert c.get("/v1/models", headers=bearer(key)).status_code == 200
    r = c.post("/v1/completions", json=COMPLETION, headers=bearer(key))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    with c.stream("POST", "/v1/completions", json=COMPLETION | {"stream": True}, headers=bearer(key)) as s:
        assert s.status_code == 200 and [ln for ln in s.iter_lines() if ln][-1] == "data: [DONE]"


def tiny_app(target_dir, **kw):
    from tidespec.engine.speculative import Engine
    from tidespec.models.target import load_target
    from tidespec.serve.server import build_app
    target, _ = load_target(target_dir)
    return build_app(Engine(target, None, EngineParams(num_draft_tokens=3, max_seq_len=256)), None, **kw)


def serve_cmd(tmp_path, port: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "tidespec.cli", "serve", "--no-capture", "--port", str(port), "--root",
            str(tmp_path), "--params", str(tmp_path / "params.yaml"), *args]


def run_server(cmd: list[str], tmp_path, env: dict[str, str]) -> subprocess.Popen:
    log = open(tmp_path / "serve.log", "w")  # closed with the process by `stop`
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT,
                            env={k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
                            | {"PYTHONPATH": str(REPO / "src")} | env)
    proc.log = log
    return proc


def stop(proc: subprocess.Popen) -> str:
    proc.terminate()
    proc.wait(60)
    proc.log.close()
    return open(proc.log.name).read()


def answers(url: str, path: str, headers: dict | None = None):
    """The status of GET `url+path`, None while nothing listens."""
    try:
        return httpx.get(url + path, headers=headers, timeout=5).status_code
    except httpx.HTTPError:
        return None


def test_tidespec_serve_takes_the_key_on_every_route_but_admin(tmp_path, tiny_target_dir):
    """`TIDESPEC_API_KEY=... tidespec serve` (embedded engine) with `serve.auth_health_metrics: true`:
    /v1 (whole and streamed), /health and /metrics take the key; /admin takes the admin token and
    only it."""
    from tidespec.adapters.process import free_port
    raw = yaml.safe_load(tiny_params_yaml(tiny_target_dir)) | {"serve": {"auth_health_metrics": True}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = run_server(serve_cmd(tmp_path, port), tmp_path, {"TIDESPEC_API_KEY": KEY, "TIDESPEC_ADMIN_TOKEN": ADMIN})
    try:
        wait_until(lambda: answers(url, "/health", bearer(KEY)) == 200, 180, "/health with the key", proc)
        with httpx.Client(base_url=url, timeout=60) as c:
            check_openai_routes(c)
            for path in ("/health", "/metrics"):
                refused(c.get(path), given=False)
                assert c.get(path, headers=bearer(KEY)).status_code == 200
            assert "tidespec:generation_tokens_total" in c.get("/metrics", headers=bearer(KEY)).text
            assert c.delete("/admin/draft/pin", headers=bearer(ADMIN)).json()["released"] is None  # no key needed
            assert c.delete("/admin/draft/pin", headers=bearer(KEY)).status_code == 401  # the key is no admin token
    finally:
        out = stop(proc)
    assert "Traceback" not in out, out


def test_the_front_door_checks_the_key_and_calls_its_backend_without_it(tmp_path, tiny_target_dir):
    """`tidespec serve --backend sglang --sglang-url URL --api-key KEY` before a keyless server (an
    embedded one standing in for SGLang): the front door answers 401 itself and forwards with no key;
    /health and /metrics stay open by default (load balancers, Prometheus)."""
    from tidespec.adapters.process import free_port
    from tidespec.bench.serve import serve_in_thread
    (tmp_path / "params.yaml").write_text(tiny_params_yaml(tiny_target_dir))
    backend = serve_in_thread(tiny_app(tiny_target_dir, serve=ServeParams(max_tokens=10)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = run_server(serve_cmd(tmp_path, port, "--backend", "sglang", "--sglang-url", backend.url, "--api-key", KEY),
                      tmp_path, {})
    try:
        wait_until(lambda: answers(url, "/health") == 200, 120, "the front door's /health, open", proc)
        with httpx.Client(base_url=url, timeout=60) as c:
            check_openai_routes(c)
            assert c.get("/metrics").status_code == 200
            m = c.get("/metrics").text
            assert 'route="/v1/completions",status="200"' in m and 'status="401"' not in m  # 401s never reach it
    finally:
        out = stop(proc)
        backend.stop()
    assert "Traceback" not in out, out


def test_a_guarded_health_and_metrics_on_the_front_door(tiny_target_dir):
    """`build_frontdoor(..., auth_health_metrics=True)`: /health and /metrics take the key too, and
    the backend's own (keyless) /health and /metrics are still read behind it."""
    from tidespec.bench.serve import serve_in_thread
    from tidespec.serve.frontdoor import build_frontdoor
    backend = serve_in_thread(tiny_app(tiny_target_dir, serve=ServeParams(max_tokens=10)))
    try:
        with TestClient(build_frontdoor(backend.url, api_key=KEY, auth_health_metrics=True)) as c:
            for path in ("/health", "/metrics"):
                refused(c.get(path), given=False)
            assert c.get("/health", headers=bearer(KEY)).json()["backend_status"] == 200
            assert "tidespec:spec_decode" in c.get("/metrics", headers=bearer(KEY)).text  # the backend's series
    finally:
        backend.stop()


def test_what_the_key_guards_on_the_embedded_app(tiny_target_dir):
    """Every route but /admin and (by default) /health and /metrics, the OpenAPI pages and unknown
    paths included; the scheme is case-insensitive; OPTIONS passes (CORS preflight); no key: all open."""
    app = tiny_app(tiny_target_dir, serve=ServeParams(max_tokens=10), api_key=KEY)
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        for path in ("/docs", "/openapi.json", "/v1/models/tidespec", "/nope", "/v1"):
            refused(c.get(path), given=False)
        assert c.get("/v1/models", headers={"Authorization": f"bearer {KEY}"}).status_code == 200
        assert c.options("/v1/completions").status_code == 405  # passed to the app, which has no OPTIONS route
        assert c.post("/admin/draft", json={"path": "x"}).status_code == 403  # admin disabled: its own answer
    with TestClient(tiny_app(tiny_target_dir, serve=ServeParams(max_tokens=10))) as c:
        assert c.post("/v1/completions", json=COMPLETION).status_code == 200  # no key configured: unchanged
    with pytest.raises(ValueError, match="the API key is empty"):
        tiny_app(tiny_target_dir, serve=ServeParams(max_tokens=10), api_key="")
    with pytest.raises(ValueError, match="auth_health_metrics guards /health and /metrics"):
        tiny_app(tiny_target_dir, serve=ServeParams(max_tokens=10, auth_health_metrics=True))


SHIPPED = REPO / "params.yaml"


def test_the_key_is_refused_at_start_when_it_cannot_work(tmp_path):
    """An empty key (flag or variable), spaces around it, `serve.auth_health_metrics` with no key, the
    admin token's value as the key, `VLLM_API_KEY` before the vLLM tidespec starts: each refused
    naming the fix. The flag wins over the variable; no key at all changes nothing."""
    p = load_params(SHIPPED)
    assert not p.serve.auth_health_metrics  # open by default: the shipped params run as before
    for flag, message in (("", "--api-key: the key is empty"), (" k ", "--api-key: the key has spaces around it")):
        with pytest.raises(ValueError, match=f"^{message}: pass the key clients send"):
            ServeLaunch.build(api_key=flag)
    assert "k3y" not in repr(ServeLaunch.build(api_key="k3y"))  # a secret: never printed with the flags
    for env, message in (({"TIDESPEC_API_KEY": ""}, "TIDESPEC_API_KEY is empty: set it"),
                         ({"TIDESPEC_API_KEY": "k", "TIDESPEC_ADMIN_TOKEN": "k"},
                          "the API key equals TIDESPEC_ADMIN_TOKEN: a client of the OpenAI routes could then swap")):
        with pytest.raises(ValueError, match=message):
            ServeLaunch().check(p, env)
    guarded = p.model_copy(update={"serve": p.serve.model_copy(update={"auth_health_metrics": True})})
    with pytest.raises(ValueError, match=r"serve.auth_health_metrics guards /health and /metrics with the API key, "
                                         r"and no key is set: set TIDESPEC_API_KEY \(or --api-key\)"):
        ServeLaunch().check(guarded, {})
    ServeLaunch().check(guarded, {"TIDESPEC_API_KEY": "k"})
    ServeLaunch.build(api_key="k").check(guarded, {})
    assert ServeLaunch.build(api_key="flag").api_key_in({"TIDESPEC_API_KEY": "env"}) == "flag"  # as vLLM's
    assert ServeLaunch().api_key_in({}) is None
    with pytest.raises(ValueError, match="VLLM_API_KEY is set: the vLLM server tidespec starts listens on 127.0.0.1"):
        ServeLaunch.build(backend="vllm").check(p, {"VLLM_API_KEY": "k"})
    far = ServeLaunch.build(backend="sglang", sglang_url="http://10.0.0.5:30000", api_key="k").check(p, {})
    assert any("forwards to your SGLang without it; keep that server on loopback" in n for n in far), far
    near = ServeLaunch.build(backend="sglang", sglang_url="http://127.0.0.1:30000", api_key="k").check(p, {})
    assert not [n for n in near if "API key" in n]
    from tidespec.cli.serve import serve_preflight
    with pytest.raises(ValueError, match="^--api-key: the key is empty"):
        serve_preflight(tmp_path, SHIPPED, publish=False, api_key="", env={})
