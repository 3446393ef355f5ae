"""The OpenAI front door before an SGLang-like backend (stand-in: tidespec's own OpenAI server on the
tiny target in a uvicorn thread; the real SGLang server test stays gpu-marked in test_sglang.py):
bodies and streams pass through unchanged, errors keep their status, exchanges are text-captured
and ingest into the live records, a dead backend is a 502 in OpenAI's envelope (the serving
module's error handlers: an unknown route is enveloped too)."""
from __future__ import annotations

import json
import shutil

from fastapi.testclient import TestClient

from conftest import add_tiny_word_tokenizer, tiny_params_yaml
from tidespec.config import EngineParams


def test_frontdoor_forwards_captures_and_reports(tmp_path, tiny_target_dir):
    from tidespec.bench.serve import serve_in_thread
    from tidespec.capture.ingest import ingest_source
    from tidespec.capture.store import read_manifest
    from tidespec.capture.text import TextCapture
    from tidespec.capture.writer import CaptureWriter
    from tidespec.config import ServeParams, load_params
    from tidespec.engine.speculative import Engine
    from tidespec.models.target import load_target
    from tidespec.serve.frontdoor import build_frontdoor
    from tidespec.serve.server import build_app
    from tidespec.workspace import Workspace

    tdir = tmp_path / "target"
    shutil.copytree(tiny_target_dir, tdir)
    add_tiny_word_tokenizer(tdir)
    target, tok = load_target(tdir)
    backend = serve_in_thread(
        build_app(
            Engine(target, None, EngineParams(num_draft_tokens=3, max_seq_len=256)), tok, ServeParams(max_tokens=10)
        )
    )
    text = TextCapture(tmp_path / "text")
    try:
        direct = TestClient(
            build_app(
                Engine(target, None, EngineParams(num_draft_tokens=3, max_seq_len=256)), tok, ServeParams(max_tokens=10)
            )
        )
        with TestClient(build_frontdoor(backend.url, text)) as c:
            chat = {"messages": [{"role": "user", "content": "t7 t99 t300"}], "max_tokens": 8, "temperature": 0}
            r = c.post("/v1/chat/completions", json=chat)
            want = direct.post("/v1/chat/completions", json=chat).json()
            assert r.status_code == 200
            got = r.json()
            assert got["choices"] == want["choices"] and got["tidespec"]["token_ids"] == want["tidespec"]["token_ids"]
            with c.stream("POST", "/v1/completions", json={"prompt": "t60 t61", "max_tokens": 6, "stream": True,
                                                       "stream_options": {"include_usage": True}}) as s:
                assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
                lines = [ln for ln in s.iter_lines() if ln]
            assert lines[-1] == "data: [DONE]" and len(lines) > 2
            bad = c.post("/v1/completions", json={"prompt": [], "max_tokens": 4})  # the backend's 4xx, unchanged
            assert bad.status_code == direct.post("/v1/completions", json={"prompt": [], "max_tokens": 4}).status_code
            assert bad.status_code >= 400
            m = c.get("/metrics").text
            assert 'tidespec:frontdoor_requests_total{route="/v1/chat/completions",status="200"} 1.0' in m
            streamed = json.loads(lines[-2][len("data: "):])["usage"]["completion_tokens"]  # its last chunk's usage
            assert f"tidespec:generation_tokens_total {float(want['usage']['completion_tokens'] + streamed)}" in m
            # "store": false (OpenAI's field): served, never captured, whole or streamed
            assert c.post("/v1/chat/completions", json=chat | {"store": False}).status_code == 200
            with c.stream("POST", "/v1/chat/completions", json=chat | {"store": False, "stream": True}) as s2:
                assert s2.status_code == 200 and [ln for ln in s2.iter_lines() if ln][-1] == "data: [DONE]"
            assert c.get("/health").json()["backend_status"] == 200
            assert c.get("/v1/models").status_code == direct.get("/v1/models").status_code  # the backend's answer
    finally:
        backend.stop()
        text.close()
    # two successful exchanges captured (neither the refused one nor the two sent with store: false)
    (f,) = list((tmp_path / "text").rglob("*.jsonl"))
    assert len(f.read_text().splitlines()) == 2
    (tmp_path / "params.yaml").write_text(tiny_params_yaml(tdir))
    w = CaptureWriter(tmp_path / "ingested", target.target_id)
    rep = ingest_source(str(tmp_path / "text"), None, Workspace(tmp_path), load_params(tmp_path / "params.yaml"),
                        target, tok, w)
    w.close()
    assert rep["records"] == 2 and rep["skipped"] == {} and len(read_manifest(tmp_path / "ingested")) == 2
    # the backend gone: 502 in OpenAI's error envelope, and /health says so
    with TestClient(build_frontdoor(backend.url, None, timeout_s=2)) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "t7"}]})
        assert r.status_code == 502 and "unreachable" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "backend_error" and r.json()["error"]["code"] == "backend_unreachable"
        assert c.get("/health").status_code == 503
        assert c.get("/v1/nope").json()["error"]["type"] == "not_found_error"  # tidespec serve's error handlers


def test_text_log_notifies_every_threshold_tokens(tmp_path):
    """The text capture's seal: every `threshold_tokens` logged tokens (usage, or one per streamed
    event without usage) call on_threshold once, off the request's path; sampled-out exchanges and
    a failing callback change nothing else."""
    import threading

    from tidespec.capture.text import TextCapture
    from tidespec.serve.textlog import TextLog, exchange_tokens
    assert exchange_tokens({"usage": {"total_tokens": 33}}) == 33
    assert exchange_tokens('data: {"x": 1}\n\ndata: {"x": 2}\n\ndata: [DONE]\n\n') == 2
    assert exchange_tokens('data: {"x": 1}\n\ndata: {"usage": {"total_tokens": 40}}\n\ndata: [DONE]\n\n') == 40
    fired, done = [], threading.Event()

    def note(n):
        fired.append(n)
        done.set()
    tl = TextLog(TextCapture(tmp_path / "t"), threshold_tokens=100, on_threshold=note)
    for i in range(3):
        tl.log(f"r{i}", {"prompt": "x"}, {"usage": {"total_tokens": 33}})
    assert fired == []  # 99 < 100
    tl.log("r3", {"prompt": "x"}, {"usage": {"total_tokens": 33}})
    assert done.wait(10) and fired == [132]
    tl.close()


def test_serve_says_at_start_when_its_sglang_url_does_not_answer(tmp_path, tiny_target_dir):
    """`tidespec serve --backend sglang --sglang-url` before a port nothing listens on: it starts (the
    user's server may come up later), says so in one line, and its /health is 503 meanwhile."""
    import os
    import subprocess
    import sys

    import httpx

    from conftest import REPO, wait_until
    from tidespec.adapters.process import free_port
    (tmp_path / "params.yaml").write_text(tiny_params_yaml(tiny_target_dir))
    dead, port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tidespec.cli", "serve", "--backend", "sglang", "--sglang-url",
                             f"http://127.0.0.1:{dead}", "--no-capture", "--port", str(port), "--root", str(tmp_path),
                             "--params", str(tmp_path / "params.yaml")], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=os.environ | {"PYTHONPATH": str(REPO / "src")})

    def status():
        try:
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code
        except httpx.HTTPError:
            return None
    try:
        assert wait_until(status, 60, "the front door", proc) == 503
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert f"serve: --sglang-url http://127.0.0.1:{dead} does not answer GET /health (ConnectError): requests fail " \
           "until it does" in out, out


def test_the_start_note_on_sglang_url_follows_its_health(capsys):
    """The same check before a server that answers: nothing said at 200; at 500, the status and what
    it means for the front door's own /health."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from tidespec.cli.serve import _note_unanswered

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(self.server.code if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_port}/"
    try:
        srv.code = 200
        _note_unanswered(url)
        assert capsys.readouterr().out == ""
        srv.code = 500
        _note_unanswered(url)
        assert " ".join(capsys.readouterr().out.split()) == (
            f"serve: --sglang-url {url} answers GET /health with 500: the front door's /health says 503 until it "
            "answers 200 (requests are forwarded meanwhile)")
    finally:
        srv.shutdown()
