"""The OpenAI routes of `tidespec serve` (after vLLM's `vllm/entrypoints/openai/api_server.py`):
`POST /v1/completions`, `POST /v1/chat/completions` (whole, or streamed with `stream: true`:
`streaming`), `GET /v1/models`, `GET /v1/models/{id}`, `GET /health`. Request bodies are the models
of `protocol` (every field honoured or refused with a 400 naming it); responses are built by
`responses` (one envelope for whole responses and streamed chunks); errors by `errors`."""
from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .protocol import ChatRequest, CompletionRequest, _Sampling
from .responses import Api, ChatApi, CompletionApi, envelope, ext, usage
from .serving import OpenAIServing
from .streaming import stream
from .structured import Constraint, parse_tool_calls

CLIENT_CLOSED = 499  # nginx's "client closed request": nobody is listening for the answer


def openai_router(serving: OpenAIServing) -> APIRouter:
    """The routes over `serving`. Errors raise `OpenAIError` (4xx naming the field; 404 for another
    model; 429 queue full; 504 timeout) or `EngineError` (500 with the request id)."""
    router = APIRouter()
    completion, chat = CompletionApi(serving.tokenizer), ChatApi(serving.tokenizer)
    started = int(time.time())

    def model_card(model_id: str) -> dict:
        """The served model, or an alias of it (serve.workload_by_model: `parent` is the served id,
        `tidespec.workload` the class its requests get)."""
        e, alias = serving.engine, model_id != serving.model
        ts = {"draft_version": e.draft_version, "num_draft_tokens": e.cfg.num_draft_tokens,
              "adaptive": e.policy is not None}
        if alias:
            ts["workload"] = serving.cfg.workload_by_model[model_id]
        return {"id": model_id, "object": "model", "created": started, "owned_by": "tidespec",
                "root": serving.model, "parent": serving.model if alias else None, "max_model_len": e.cfg.max_seq_len,
                "tidespec": ts}

    @router.get("/v1/models")
    def models():
        return {"object": "list", "data": [model_card(m) for m in serving.models]}

    @router.get("/v1/models/{model_id:path}")
    def model_entry(model_id: str):
        serving.check_model(model_id)
        return model_card(model_id)

    @router.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompts = [serving.encode(p) for p in body.prompts()]
        return await respond(serving, completion, body, request, prompts, body.logprobs, echo=body.echo)

    @router.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        con = await asyncio.to_thread(serving.constraint, body)  # schema checks and compiling: off the event loop
        return await respond(serving, chat, body, request, [serving.chat_prompt(body)], body.num_logprobs(),
                             constraint=con)

    @router.get("/health")
    def health():
        versions = serving.engine.draft_versions
        return {"status": "ok", "replica_id": serving.cfg.replica_id, "canary": serving.cfg.canary,
                "draft_version": serving.engine.draft_version,
                "class_drafts": {w: v for w, v in sorted(versions.items()) if w},
                "requests": serving.engine.num_unfinished,
                "target_precision": serving.engine.target.precision}  # target.dtype × target.quantization

    return router


async def respond(serving: OpenAIServing, api: Api, body: _Sampling, request: Request, prompts: list[list[int]],
                  logprobs: int | None, echo: bool = False, constraint: Constraint | None = None) -> dict | Response:
    """One OpenAI request: streamed (`body.stream`) or the whole response once every choice is done
    (499 when the client went away meanwhile). `prompts`: token ids, one list per prompt;
    `logprobs`: top alternatives per token (None: none); `echo`: the prompt's text first (completions);
    `constraint`: the grammar of structured output or tool calls (a tool-calling choice's calls are
    parsed into `tool_calls`)."""
    if body.stream:
        return stream(serving, api, body, prompts, logprobs, echo, constraint)
    adm = serving.admit(body, api, prompts, logprobs, constraint=constraint)
    gens = await serving.collect(request, adm)
    if gens is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = []
    for c, g in zip(adm.choices, gens):
        c.prefix = serving.echo_prefix(adm, c) if echo else ""
        text, calls = c.prefix + c.text_so_far, None
        if c.calls is not None:
            text, calls = parse_tool_calls(text)
        choices.append(api.choice(c.index, text, delta=False, lps=g.logprobs, offsets=c.offsets(0, len(g.tokens)),
                                  base=len(c.prefix), finish=g, calls=calls, called=bool(calls)))
    resp = envelope(api, adm.request_id, int(time.time()), body.model or serving.model, choices,
                    usage=usage(prompts, sum(len(g.tokens) for g in gens)), tidespec=ext(gens[0]))
    serving.log_text(body, resp, adm)
    return resp
