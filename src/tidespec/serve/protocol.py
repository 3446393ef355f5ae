"""OpenAI request models for `/v1/completions` and `/v1/chat/completions`: every field of OpenAI's
API reference (and vLLM's sampling extensions) is listed, and each is honoured or refused with a 400
naming it. Unknown fields are refused too (`extra="forbid"`): a client never gets a 200 whose
output silently ignored what it asked for. docs/api.md's parameter table is the user-facing list.

Semantics follow vLLM's OpenAI server (`vllm/entrypoints/openai/protocol.py`) where OpenAI is
silent: `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`, `ignore_eos`, `min_tokens`,
`include_stop_str_in_output`, `skip_special_tokens` sit at the top level of the body (the `openai`
SDK's `extra_body`); `workload` is tidespec's (the class the adaptive policy and capture key on).
A refusal raises `errors.OpenAIError` (400 naming the field; OpenAI's envelope).
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..engine.sampling import MAX_LOGPROBS, SamplingParams
from .errors import OpenAIError

MAX_STOP = 4  # OpenAI: up to 4 stop sequences
MAX_N = 16


def _refuse(name: str, why: str) -> OpenAIError:
    return OpenAIError(f"{name} is not supported by this server: {why}", param=name, code="unsupported_parameter")


class _Strict(BaseModel):
    """Unknown fields refused; no lax coercion ("5" is not an integer, true is not 1), as OpenAI."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    """`include_usage`: one extra last chunk with `usage` and no choices (OpenAI);
    `continuous_usage_stats`: usage so far in every chunk (vLLM)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


# fields OpenAI defines that this server does not implement: refused (400) when set to anything
# but their "off" value; the reason is in the error and in the README table
_CHAT_UNSUPPORTED = {
    "functions": ("deprecated function calling is not served; use tools", (None, [])),
    "function_call": ("deprecated function calling is not served; use tool_choice", (None, "none")),
    "audio": ("the target is text-only", (None,)),
    "modalities": ("the target is text-only (only [\"text\"])", (None, ["text"])),
    "prediction": ("predicted outputs are not served (speculation uses the draft)", (None,)),
    "store": ("stored completions are not kept", (None, False)),
    "reasoning_effort": ("the target is not a reasoning model", (None,)),
    "verbosity": ("the target has no verbosity control", (None,)),
    "web_search_options": ("no web search", (None,)),
    "service_tier": ("one tier is served ('auto' or 'default' accepted)", (None, "auto", "default")),
    "prompt_cache_key": ("no prompt cache", (None,)),
    "safety_identifier": ("not recorded; use `user`", (None,)),
}


class _Sampling(_Strict):
    """Fields both routes share (OpenAI + vLLM extensions)."""

    model: str | None = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    user: str | None = None
    # vLLM sampling extensions
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    repetition_penalty: float = Field(1.0, gt=0, le=10)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # tidespec
    workload: str | None = Field(None, min_length=1, max_length=64)

    def constrained(self) -> bool:
        """Does the request constrain its output to a grammar? (chat: `ChatRequest.constrained`)"""
        return False

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, b in (v or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys are token ids (strings of integers >= 0), got {key!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"logit_bias[{key}] must be in [-100, 100], got {b}")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if any(t < 0 for t in v or []):
            raise ValueError("stop_token_ids must be token ids >= 0")
        return v

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options is only allowed with stream: true", param="stream_options")
        return self

    def stops(self) -> list[str]:
        """The stop strings (0 to 4)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling(self, default_temperature: float, seed_offset: int = 0, logprobs: int | None = None
                 ) -> SamplingParams:
        """SamplingParams of choice `seed_offset` (n > 1: choice i uses seed + i, so the choices are
        independent and each reproducible). Raises OpenAIError naming the field for a bad value."""
        try:
            return SamplingParams(
                temperature=self.temperature if self.temperature is not None else default_temperature,
                top_p=self.top_p, top_k=max(self.top_k, 0), min_p=self.min_p,
                seed=None if self.seed is None else (self.seed + seed_offset) % 2**63,
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                logit_bias={int(k): float(v) for k, v in (self.logit_bias or {}).items()},
                min_tokens=self.min_tokens, stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos, logprobs=logprobs)
        except ValueError as e:
            raise OpenAIError(str(e), param=str(e).split(" ", 1)[0]) from None

    def max_new(self) -> int | None:
        """The most tokens to generate (None: the server's default, serve.max_tokens)."""
        return self.max_tokens


class CompletionRequest(_Sampling):
    """`/v1/completions`. prompt: a string, a list of token ids, or a list of either (one choice
    group per prompt); echo: the prompt's text before the completion; best_of: only equal to n
    (vLLM v1 dropped server-side best-of too); suffix: refused (no fill-in-the-middle);
    logprobs: 0–20 top alternatives per token."""

    prompt: str | list[int] | list[str] | list[list[int]]
    suffix: str | None = None
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _refusals(self):
        if self.suffix is not None:
            raise _refuse("suffix", "fill-in-the-middle is not served; put the text in the prompt")
        if self.best_of is not None and self.best_of != self.n:
            raise _refuse("best_of", "server-side best-of is not served (vLLM v1 dropped it too); use n and rank "
                          "the choices by their logprobs")
        if self.echo and self.logprobs is not None:
            raise _refuse("echo", "echo with logprobs would need prompt logprobs, which are not computed")
        if isinstance(self.prompt, list) and not self.prompt:
            raise OpenAIError("prompt must not be empty", param="prompt")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per choice group."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def class_texts(self) -> list[str | None]:
        """Per prompt, the text its workload class is read from (`serve.workload`); None for a
        token-id prompt (the server decodes it)."""
        return [p if isinstance(p, str) else None for p in self.prompts()]


class TextPart(_Strict):
    """A content part; only text (the target is text-only)."""

    type: Literal["text"]
    text: str


NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's pattern for function and schema names


class FunctionCall(_Strict):
    """A call an earlier assistant message made: `arguments` is a JSON object as a string."""

    name: str = Field(pattern=NAME)
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json(cls, v):
        try:
            obj = json.loads(v)
        except ValueError:
            raise ValueError("arguments must be a JSON object encoded as a string") from None
        if not isinstance(obj, dict):
            raise ValueError("arguments must be a JSON object encoded as a string")
        return v


class ToolCall(_Strict):
    id: str = Field(min_length=1)
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(_Strict):
    """A chat message. developer is OpenAI's newer name for system and is rendered as system;
    assistant tool_calls and tool messages are rendered in the tool-call format (`structured`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    refusal: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v):
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content part {i} has type {kind!r}: only 'text' parts are accepted "
                                     "(the target is text-only)")
        return v

    @model_validator(mode="after")
    def _check(self):
        if self.name is not None:
            raise _refuse("messages.name", "the target's chat template has no participant names; put the name "
                          "in the content")
        if self.tool_calls is not None and self.role != "assistant":
            raise OpenAIError("only assistant messages carry tool_calls", param="messages.tool_calls")
        if self.content is None and self.role != "assistant":
            raise OpenAIError(f"a {self.role} message needs content", param="messages.content")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise OpenAIError("role 'tool' messages need a tool_call_id, and only they take one",
                              param="messages.tool_call_id")
        return self

    def for_template(self) -> dict:
        """The message as the chat template gets it: parts joined, developer → system."""
        text = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(p.text for p in self.content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": text or ""}
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class JsonSchemaFormat(_Strict):
    """`response_format.json_schema`: name, description, the schema, strict (the output is always
    constrained to the schema exactly, strict or not)."""

    name: str = Field(pattern=NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _needs_schema(self):
        if self.schema_ is None:
            raise OpenAIError("response_format.json_schema.schema is required (the JSON schema of the output)",
                              param="response_format.json_schema.schema")
        return self


class ResponseFormat(_Strict):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object), json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _pair(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise OpenAIError("response_format.json_schema is given with type json_schema, and only then",
                              param="response_format.json_schema")
        return self


class FunctionDef(_Strict):
    """A tool's function: name, description, parameters (a JSON schema; none: any object), strict."""

    name: str = Field(pattern=NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(_Sampling):
    """`/v1/chat/completions`. logprobs: bool with top_logprobs 0–20; max_completion_tokens:
    OpenAI's newer name for max_tokens (give one); response_format, tools, tool_choice,
    parallel_tool_calls: grammar-constrained output (`structured`); metadata: up to 16 string pairs,
    logged with the request by text capture."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None
    metadata: dict[str, str] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    store: bool | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="after")
    def _refusals(self):
        for name, (why, ok) in _CHAT_UNSUPPORTED.items():
            if getattr(self, name) not in ok:
                raise _refuse(name, why)
        self._check_tools()
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs: true", param="top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise OpenAIError("max_tokens and max_completion_tokens differ: send one", param="max_completion_tokens")
        if self.metadata is not None and (len(self.metadata) > 16 or any(len(k) > 64 or len(v) > 512
                                                                         for k, v in self.metadata.items())):
            raise OpenAIError("metadata holds at most 16 pairs (keys ≤ 64, values ≤ 512 characters)",
                              param="metadata")
        return self

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise OpenAIError("tools must have distinct function names", param="tools")
        if not names and self.tool_choice not in (None, "none"):
            raise OpenAIError("tool_choice needs tools", param="tool_choice")
        if not names and self.parallel_tool_calls is not None:
            raise OpenAIError("parallel_tool_calls needs tools", param="parallel_tool_calls")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise OpenAIError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools "
                              f"({', '.join(names)})", param="tool_choice")

    def max_new(self) -> int | None:
        """The most tokens to generate: max_completion_tokens or max_tokens (None: the server's default)."""
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        """Top alternatives per token to return (None: no logprobs; 0: the chosen token's only)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        """The messages as the chat template gets them (`ChatMessage.for_template`)."""
        return [m.for_template() for m in self.messages]

    def class_texts(self) -> list[str | None]:
        """The text the workload class is read from (`serve.workload`): the user messages, joined
        (a follow-up turn keeps the class of the conversation it continues)."""
        return ["\n".join(m["content"] for m in self.template_messages() if m["role"] == "user")]

    def constrained(self) -> bool:
        """Does the request constrain its output (response_format json_object / json_schema, or tools
        the model may call)?"""
        return (self.response_format is not None and self.response_format.type != "text") or \
            bool(self.tools and self.tool_choice != "none")
