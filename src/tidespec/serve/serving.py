"""The OpenAI serving core shared by `/v1/completions` and `/v1/chat/completions`, streamed or not
(after vLLM's `OpenAIServing`, `vllm/entrypoints/openai/serving_engine.py`): prompts to token ids,
admission (n engine requests per prompt, queue limit, the request's checks), waiting for the
engine with client-disconnect and timeout aborts, one engine result → metrics, text capture.

Errors: a client error raises `OpenAIError` 4xx naming the field (`param`), before anything is
queued; a request the engine failed raises `EngineError` (500, the request id in message and body).
A `ValueError` is a client error only where it comes from checking the request (the engine's
`validate`, tokenization, sampling parameters), never when the engine's Future carries it.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from fastapi import Request
from pydantic import BaseModel

from ..config import ServeParams
from ..engine.grammar_state import GrammarCompiler
from ..engine.invalid import InvalidRequest
from ..engine.speculative import Engine, Generation
from ..engine.speculative import Request as EngineRequest
from ..models.chat import chat_ids
from ..models.detok import TextOutput
from . import structured
from .engine_loop import EngineLoop
from .errors import EngineError, OpenAIError, RequestTimeout
from .metrics import FinishedRequestStats, ServeMetrics
from .protocol import ChatRequest, _Sampling
from .responses import Api
from .structured import Constraint, ToolCallStream
from .textlog import TextLog
from .workload import workload_of

# an engine request field → the OpenAI parameter a client changes (`InvalidRequest.field`); others keep their name
PARAMS = {"max_new_tokens": "max_tokens", "grammar": None, "sampling": None, "k": None,
          "request_id": None}
log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.05  # how often a waiting non-streamed request checks that its client is still there, s

OnTokens = Callable[[list[int], list | None], None]


@dataclass
class Choice:
    """One engine request of an HTTP request (prompt i, sample j → choice index i·n + j)."""

    index: int
    req: EngineRequest
    fut: Future
    text: TextOutput | None  # None: no tokenizer, no text
    prefix: str = ""  # echo: the prompt's text
    delivered: int = 0  # tokens streamed so far
    lp_pending: list = field(default_factory=list)  # streamed (TokenLogprob, text offset) not yet sent
    observed: bool = False  # its Generation is on /metrics
    calls: ToolCallStream | None = None  # a tool-calling choice's streamed calls

    @property
    def text_so_far(self) -> str:
        return self.text.text if self.text is not None else ""

    def offsets(self, start: int, count: int) -> list[int]:
        """Character offsets of tokens start..start+count into the text (clamped to its length)."""
        if self.text is None:
            return [0] * count
        return [min(o, len(self.text.text)) for o in self.text.offsets[start:start + count]]


@dataclass
class Admitted:
    """An HTTP request's engine requests: `request_id` (choice 0's engine request id, the response
    id's suffix and the capture's event id), `prompts` (token ids), `choices` (`n` per prompt)."""

    request_id: str
    prompts: list[list[int]]
    n: int
    choices: list[Choice] = field(default_factory=list)

    def prompt_of(self, c: Choice) -> list[int]:
        return self.prompts[c.index // self.n]


class OpenAIServing:
    """Admission, waiting and accounting of OpenAI requests on `engine` (stepped by `loop`).
    `tokenizer`: HF fast tokenizer (None: token-id prompts only, no chat, no stop strings); `cfg`:
    the resolved serve limits; `model`: the served id; `textlog`: text capture of finished exchanges."""

    def __init__(self, engine: Engine, loop: EngineLoop, metrics: ServeMetrics, tokenizer, cfg: ServeParams,
                 model: str, textlog: TextLog):
        self.engine, self.loop, self.metrics, self.tokenizer = engine, loop, metrics, tokenizer
        self.cfg, self.model, self.textlog = cfg, model, textlog
        self._observe_lock = threading.Lock()

    # -- prompts --------------------------------------------------------------------------
    def encode(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        """A completion prompt → token ids. Raises OpenAIError 400 (`param`) for text without a
        tokenizer or text that cannot be tokenized."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise OpenAIError("this server has no tokenizer: send the prompt as a list of token ids", param=param)
            return self.tokenize(lambda: self.tokenizer(prompt, add_special_tokens=False)["input_ids"], param)
        return list(prompt)

    def chat_prompt(self, body: ChatRequest) -> list[int]:
        """The chat template applied to `body.messages` → token ids. Raises OpenAIError 400
        ("messages") when the target has no chat template or the messages cannot be tokenized."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError("this server's target has no chat template: use /v1/completions", param="messages")
        messages = body.template_messages()
        if body.tools or any("tool_calls" in m for m in messages):
            messages = structured.render(messages, [t.model_dump(exclude_none=True) for t in body.tools or []])
        return self.tokenize(lambda: chat_ids(self.tokenizer, messages, True), "messages")

    @functools.cached_property
    def grammars(self) -> GrammarCompiler | None:
        """The grammar compiler for this target's tokenizer (built at the first constrained
        request, ~0.4 s; None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        return GrammarCompiler.for_target(self.engine.target, self.tokenizer)

    def constraint(self, body: ChatRequest) -> Constraint | None:
        """The request's grammar (`structured.build`; None: unconstrained). Raises OpenAIError 400."""
        return structured.build(body, self.grammars if body.constrained() else None)

    @staticmethod
    def tokenize(fn: Callable[[], list[int]], param: str) -> list[int]:
        """`fn()` (a tokenization); its TypeError / ValueError / UnicodeError (e.g. a lone UTF-16
        surrogate) → OpenAIError 400 naming `param`."""
        try:
            return fn()
        except (TypeError, ValueError, UnicodeError) as e:
            raise OpenAIError(f"{param} cannot be tokenized: {e}", param=param) from None

    # -- admission ------------------------------------------------------------------------
    def admit(self, body: _Sampling, api: Api, prompts: list[list[int]], logprobs: int | None,
              on_tokens: Callable[[int], OnTokens] | None = None, constraint: Constraint | None = None) -> Admitted:
        """Queue `body.n` engine requests per prompt (`on_tokens(choice index)`: the streaming
        callback of each; `constraint`: the grammar every choice follows). Raises OpenAIError — 404 another model, 429
        queue full, 400 naming the
        field for anything the request asks that cannot be served — and then nothing is queued."""
        max_new = self._check(body, len(prompts))
        # the text of a stop token (stop_token_ids, EOS) is left out unless include_stop_str_in_output (vLLM)
        eos = () if body.ignore_eos else self.engine.target.cfg.eos_token_ids
        stop_ids = set(body.stop_token_ids or ()) | set(eos)
        stops = body.stops()
        if stops and self.tokenizer is None:
            raise OpenAIError("stop strings need a tokenizer; this server has none: use stop_token_ids", param="stop")
        adm = Admitted(uuid.uuid4().hex, prompts, body.n)
        classes = self.workloads(body, prompts)
        try:
            for i, ids in enumerate(prompts):
                for j in range(body.n):
                    idx = i * body.n + j
                    text = self._text_output(body, stops, stop_ids, ids)
                    rid = adm.request_id if idx == 0 else f"{adm.request_id}-{idx}"
                    req = EngineRequest(
                        ids,
                        max_new,
                        request_id=rid,
                        capture=False if getattr(body, "store", None) is False else None,
                        sampling=body.sampling(self.cfg.default_temperature, j, logprobs),
                        workload=classes[i],
                        stop=text,
                        on_tokens=on_tokens(idx) if on_tokens else None,
                        grammar=constraint.grammar if constraint is not None else None,
                    )
                    calls = ToolCallStream() if constraint is not None and constraint.tools else None
                    adm.choices.append(Choice(idx, req, self._submit(req, api.prompt_param), text, calls=calls))
        except BaseException:
            for c in adm.choices:
                self.engine.abort(c.req.request_id)
            raise
        self.metrics.set_running(self.engine.num_unfinished)
        return adm

    def workloads(self, body: _Sampling, prompts: list[list[int]]) -> list[str]:
        """Each prompt's workload class (`serve.workload.workload_of`): the `workload` field, the
        model alias's class, then — unless serve.classify_workload is false ("default") —
        `structured`, or the prompt's content (token-id prompts decoded only when it decides)."""
        constrained, texts = body.constrained(), body.class_texts()
        return [workload_of(body.workload, body.model, self.cfg.workload_by_model, constrained,
                            (lambda t=text: t) if text is not None else (lambda ids=ids: self._decode(ids)),
                            self.cfg.classify_workload)
                for text, ids in zip(texts, prompts)]

    def _decode(self, ids: list[int]) -> str:
        """A token-id prompt's text for classifying it: its first 1024 tokens, ids outside the
        vocabulary left out (the engine refuses them with a 400); "" without a tokenizer."""
        if self.tokenizer is None:
            return ""
        V = self.engine.target.cfg.vocab_size
        return self.tokenizer.decode([t for t in ids[:1024] if isinstance(t, int) and 0 <= t < V])

    @property
    def models(self) -> list[str]:
        """The model ids this server answers to: the served one, then serve.workload_by_model's aliases."""
        return [self.model, *(m for m in self.cfg.workload_by_model if m != self.model)]

    def check_model(self, model: str | None) -> None:
        """Raise OpenAIError 404 `model_not_found` unless `model` is None or one of `models`."""
        if model is not None and model not in self.models:
            raise OpenAIError(f"the model {model!r} does not exist; this server serves "
                              f"{', '.join(map(repr, self.models))} (GET /v1/models)", param="model", status=404,
                              code="model_not_found")

    def _check(self, body: _Sampling, n_prompts: int) -> int:
        """The request's limits; returns its max new tokens."""
        self.check_model(body.model)
        total, cap = n_prompts * body.n, self.cfg.max_queue
        if total > cap:
            raise OpenAIError(f"{n_prompts} prompts × n {body.n} = {total} sequences can never fit "
                              f"serve.max_queue {cap}; send fewer", param="n")
        if self.engine.num_unfinished + total > cap:
            self.metrics.rejected.inc()
            raise OpenAIError(f"{self.engine.num_unfinished} requests queued, {total} more would exceed "
                              f"serve.max_queue {cap}; retry later", status=429, code="queue_full",
                              headers={"Retry-After": "1"})
        max_new = body.max_new() or self.cfg.max_tokens
        if max_new > self.cfg.max_tokens:
            raise OpenAIError(f"max_tokens {max_new} exceeds this server's cap {self.cfg.max_tokens} "
                              "(serve.max_tokens; unset, engine.max_new_tokens)", param="max_tokens")
        if body.min_tokens > max_new:
            raise OpenAIError(f"min_tokens {body.min_tokens} exceeds max_tokens {max_new}", param="min_tokens")
        return max_new

    def _text_output(self, body: _Sampling, stops: list[str], stop_ids: set[int], ids: list[int]) -> TextOutput | None:
        if self.tokenizer is None:
            return None
        try:
            return TextOutput(self.tokenizer, stops, body.include_stop_str_in_output, body.skip_special_tokens,
                              stop_ids, prompt_ids=ids)
        except ValueError as e:
            raise OpenAIError(str(e), param="stop") from None

    def _submit(self, req: EngineRequest, prompt_param: str) -> Future:
        """Queue the request; the engine's refusal (`InvalidRequest`) is a 400 naming the OpenAI
        parameter its field maps to (`PARAMS`; the prompt's own parameter for prompt_ids)."""
        try:
            return self.loop.submit(req)
        except InvalidRequest as e:  # the request, not the engine
            raise OpenAIError(str(e), param=prompt_param if e.field == "prompt_ids" else PARAMS.get(e.field, e.field)) \
                from None

    # -- results --------------------------------------------------------------------------
    async def collect(self, request: Request, adm: Admitted) -> list[Generation] | None:
        """Wait for every choice; None when the client went away (all aborted within one engine
        step). Raises RequestTimeout (504) after serve.request_timeout_s s (all aborted), EngineError
        (500) when the engine failed a choice."""
        pending = {asyncio.wrap_future(c.fut) for c in adm.choices}
        deadline = time.monotonic() + self.cfg.request_timeout_s
        while pending:
            _, pending = await asyncio.wait(pending, timeout=DISCONNECT_POLL_S)
            if pending and await request.is_disconnected():
                self.abort(adm.choices)
                return None
            if pending and time.monotonic() > deadline:
                self.abort(adm.choices)
                raise RequestTimeout(self.cfg.request_timeout_s)
        gens, error = [], None
        for c in adm.choices:  # every finished choice is counted, even when another one failed
            try:
                gens.append(self.result(adm, c))
            except EngineError as e:
                error = error or e
        if error is not None:
            raise error
        return gens

    def result(self, adm: Admitted, c: Choice) -> Generation:
        """A done choice's Generation, counted on /metrics. Raises EngineError (500, `adm`'s request
        id) when the engine failed it; the cause goes to the server log only."""
        exc = c.fut.exception()
        if exc is not None:
            raise EngineError.of(adm.request_id, exc, c.req.request_id)
        g = c.fut.result()
        self.finished(c, g)
        return g

    def finished(self, c: Choice, g: Generation) -> None:
        """Count a finished (or aborted) choice on /metrics, once."""
        with self._observe_lock:
            if c.observed:
                return
            c.observed = True
        if g.grammar_error:
            log.warning("request %s: its grammar could not go on (finish_reason length): %s", g.request_id,
                        g.grammar_error.splitlines()[0])
        self.metrics.observe(FinishedRequestStats.of(g))
        self.metrics.set_running(self.engine.num_unfinished)

    def abort(self, choices: list[Choice]) -> None:
        """Abort every unfinished choice (freed at the next engine step, never captured); each is
        counted as request_success{finished_reason="abort"} when the engine lets it go."""
        for c in choices:
            self.engine.abort(c.req.request_id)
            c.fut.add_done_callback(lambda f, c=c: f.exception() is None and self.finished(c, f.result()))

    def echo_prefix(self, adm: Admitted, c: Choice) -> str:
        """The text of choice `c`'s prompt (echo), "" without a tokenizer."""
        return self.tokenizer.decode(adm.prompt_of(c)) if self.tokenizer is not None else ""

    def log_text(self, body: BaseModel, response: dict | str, adm: Admitted) -> None:
        """Text-capture a finished exchange under `adm.request_id` (= the live capture's request id);
        a request sent with `"store": false` is never captured."""
        if getattr(body, "store", None) is False:
            return
        self.textlog.log(adm.request_id, body.model_dump(exclude_none=True, by_alias=True), response)
