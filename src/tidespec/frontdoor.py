"""OpenAI front door for an SGLang serving process (`tidespec serve --backend sglang --sglang-url URL`).

SGLang serves the OpenAI routes itself (`/v1/completions`, `/v1/chat/completions`, `/v1/models`); on a
GPU it is the engine (EAGLE3 drafts included, `engine/sglang.py` launches it). The front door forwards
those routes unchanged — request bodies as sent, responses and server-sent-event streams byte for
byte, the backend's status codes and error bodies — and adds what the loop needs: text capture of each
successful exchange in the SageMaker Data Capture format (`capture.text`, `capture.mode: text`; the
`tide_capture` flow rehydrates it), and Prometheus metrics (`tidespec:frontdoor_requests_total{route,
status}`, `..._latency_seconds`, `prompt_tokens_total` / `generation_tokens_total` from the responses'
usage). Parameters are the backend's to honour or refuse: nothing is dropped here. A backend that
cannot be reached gets 502 in OpenAI's error envelope.
"""
from __future__ import annotations

import json
import time
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

ROUTES = ("/v1/completions", "/v1/chat/completions")


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "backend_error", "param": None, "code": status}},
                        status_code=status)


def _usage_from_sse(text: str) -> dict:
    """The last `usage` object of an SSE stream (present when the client asked for include_usage)."""
    usage = {}
    for line in text.splitlines():
        if line.startswith("data:") and line[5:].strip() not in ("", "[DONE]"):
            try:
                usage = json.loads(line[5:]).get("usage") or usage
            except (json.JSONDecodeError, AttributeError):
                continue
    return usage


def build_frontdoor(backend_url: str, text_capture=None, timeout_s: float = 300.0) -> FastAPI:
    """The FastAPI app in front of `backend_url` (e.g. http://127.0.0.1:30000). `text_capture`: a
    `capture.text.TextCapture` (None: no capture); `timeout_s`: per backend request, s (504 after)."""
    base = backend_url.rstrip("/")
    reg = CollectorRegistry()
    requests = Counter("tidespec:frontdoor_requests", "Requests forwarded, by route and backend status.",
                       ["route", "status"], registry=reg)
    latency = Histogram("tidespec:frontdoor_latency_seconds", "Backend time per request (to the last byte).",
                        ["route"], registry=reg, buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))
    prompt_tokens = Counter("tidespec:prompt_tokens", "Prompt tokens (backend usage).", registry=reg)
    gen_tokens = Counter("tidespec:generation_tokens", "Generated tokens (backend usage).", registry=reg)
    client = httpx.AsyncClient(timeout=timeout_s)
    app = FastAPI(title="tidespec front door", version="0.1")

    @app.on_event("shutdown")
    async def _close():
        await client.aclose()
        if text_capture is not None:
            text_capture.close()

    def account(route: str, status: int, t0: float, usage: dict) -> None:
        requests.labels(route=route, status=str(status)).inc()
        latency.labels(route=route).observe(time.perf_counter() - t0)
        prompt_tokens.inc(usage.get("prompt_tokens", 0) or 0)
        gen_tokens.inc(usage.get("completion_tokens", 0) or 0)

    def capture(body: dict, response: dict | str, rid: str | None) -> None:
        if text_capture is not None:
            text_capture.log(rid or uuid.uuid4().hex, body, response)

    async def forward(route: str, request: Request):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except json.JSONDecodeError:
            body = None
        t0 = time.perf_counter()
        headers = {"content-type": "application/json"}
        streaming = isinstance(body, dict) and bool(body.get("stream"))
        try:
            if streaming:
                req = client.build_request("POST", base + route, content=raw, headers=headers)
                resp = await client.send(req, stream=True)
            else:
                resp = await client.post(base + route, content=raw, headers=headers)
        except httpx.TimeoutException:
            requests.labels(route=route, status="504").inc()
            return _error(504, f"backend {base} did not answer within {timeout_s:g} s")
        except httpx.HTTPError as e:
            requests.labels(route=route, status="502").inc()
            return _error(502, f"backend {base} unreachable: {e}")
        if streaming:
            if resp.status_code != 200:
                data = await resp.aread()
                account(route, resp.status_code, t0, {})
                return Response(data, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

            async def relay():
                sent = []
                try:
                    async for chunk in resp.aiter_bytes():
                        sent.append(chunk)
                        yield chunk
                finally:
                    await resp.aclose()
                text = b"".join(sent).decode("utf-8", "replace")
                account(route, 200, t0, _usage_from_sse(text))
                if text.rstrip().endswith("[DONE]"):  # a complete stream only
                    capture(body, text, None)
            return StreamingResponse(relay(), media_type="text/event-stream")
        data = resp.content
        out = None
        try:
            out = json.loads(data)
        except json.JSONDecodeError:
            pass
        usage = out.get("usage") if isinstance(out, dict) else None
        account(route, resp.status_code, t0, usage or {})
        if resp.status_code == 200 and isinstance(out, dict) and isinstance(body, dict):
            capture(body, out, out.get("id"))
        return Response(data, status_code=resp.status_code, media_type=resp.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await forward("/v1/chat/completions", request)

    async def backend_get(path: str, down_status: int):
        """GET `path` on the backend: (response, None), or (None, the error reply with `down_status`)."""
        try:
            return await client.get(base + path), None
        except httpx.HTTPError as e:
            return None, _error(down_status, f"backend {base} unreachable: {e}")

    @app.get("/v1/models")
    async def models():
        r, err = await backend_get("/v1/models", 502)
        return err or Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))

    @app.get("/health")
    async def health():
        r, err = await backend_get("/health", 503)
        if err:
            return err
        ok = r.status_code == 200
        return JSONResponse({"status": "ok" if ok else "backend unhealthy", "backend": base,
                             "backend_status": r.status_code}, status_code=200 if ok else 503)

    @app.get("/metrics")
    def prom():
        return Response(generate_latest(reg), media_type=CONTENT_TYPE_LATEST)

    return app
