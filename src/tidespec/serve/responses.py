"""The shapes of OpenAI responses, streamed and whole, built in one place: `envelope` wraps the choices
of a whole response (`text_completion`, `chat.completion`) and of every streamed chunk
(`text_completion`, `chat.completion.chunk`); `CompletionApi` and `ChatApi` build one choice —
whole or a delta — and its logprobs in the route's format. Per choice vLLM's `stop_reason` and a
`tidespec` field (token ids; on the last piece also the draft version and the request's τ) are added.
"""
from __future__ import annotations

from ..engine.sampling import TokenLogprob
from ..engine.speculative import Generation
from ..models.detok import token_text_and_bytes

MIN_LOGPROB = -9999.0  # a token a grammar or min_tokens masks has logprob -inf; JSON has no -inf (vLLM clamps the same)


def _lp(v: float) -> float:
    return max(v, MIN_LOGPROB)


def usage(prompts: list[list[int]], completion_tokens: int) -> dict:
    """OpenAI's `usage` (tokens) for `prompts` (token ids, one list per prompt) and the tokens generated."""
    p = sum(len(x) for x in prompts)
    return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}


def ext(g: Generation) -> dict:
    """The `tidespec` field of a finished choice: its token ids, the draft version that served it,
    its acceptance length τ (tokens per draft-verify step), number of draft-verify steps and workload
    class (`serve.workload`); with
    `grammar_error`, why its grammar could not go on (finish_reason length)."""
    d = {"token_ids": g.tokens, "draft_version": g.draft_version,
         "acceptance_length": g.stats.acceptance_length, "num_drafts": g.stats.num_drafts, "workload": g.workload}
    return d | ({"grammar_error": g.grammar_error.splitlines()[0]} if g.grammar_error else {})


class Api:
    """One OpenAI route's response format. `object` / `chunk_object`: the envelope's object of a
    whole response / a streamed chunk; `id_prefix`: the response id is `<id_prefix>-<request id>`;
    `prompt_param`: the request field holding the prompt (named by a 400 about it). `tokenizer`: HF
    tokenizer for token texts (None: a token's text is its id)."""

    object = chunk_object = id_prefix = prompt_param = ""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer

    def token_text(self, t: int) -> tuple[str, bytes]:
        """Token id → (its text, its bytes)."""
        return token_text_and_bytes(self.tokenizer, t) if self.tokenizer is not None else (str(t), str(t).encode())

    def choice(self, index: int, text: str, *, delta: bool, lps: list[TokenLogprob] | None = None,
               offsets: list[int] = (), base: int = 0, finish: Generation | None = None,
               token_ids: list[int] | None = None, calls: list[dict] | None = None, called: bool = False) -> dict:
        """One choice: whole (`delta` False) or a streamed piece. `text`: its text (or the piece's);
        `lps`: its tokens' logprobs (None: not asked, or none in this piece) with `offsets`:
        characters into the choice's text, plus `base` (an echoed prompt's length); `finish`: the
        finished Generation (None: more pieces follow); `token_ids`: a piece's new token ids;
        `calls`: tool calls (whole: OpenAI `tool_calls`; a piece: its `delta.tool_calls` entries);
        `called`: the choice made tool calls (finish_reason "tool_calls")."""
        reason = (
            ("tool_calls" if called and finish.finish_reason == "stop" else finish.finish_reason) if finish else None
        )
        d = {"index": index, **self.content(text, delta, calls), "finish_reason": reason,
             "logprobs": self.logprobs(lps, offsets, base) if lps is not None else None}
        if finish is not None:
            d |= {"stop_reason": finish.stop_reason, "tidespec": ext(finish)}
        elif token_ids is not None:
            d["tidespec"] = {"token_ids": token_ids}
        return d

    def opening(self, index: int, prefix: str | None) -> dict | None:
        """A choice's first streamed piece, before any token (None: none). `prefix`: the echoed
        prompt's text (None: no echo)."""
        return None

    def content(self, text: str, delta: bool, calls: list[dict] | None = None) -> dict:
        raise NotImplementedError

    def logprobs(self, lps: list[TokenLogprob], offsets: list[int], base: int) -> dict:
        raise NotImplementedError


class CompletionApi(Api):
    """`/v1/completions`: choices carry `text`; logprobs in OpenAI's legacy format; a streamed
    choice with echo opens with the prompt's text."""

    object = chunk_object = "text_completion"
    id_prefix, prompt_param = "cmpl", "prompt"

    def content(self, text: str, delta: bool, calls: list[dict] | None = None) -> dict:
        return {"text": text}

    def opening(self, index: int, prefix: str | None) -> dict | None:
        return None if prefix is None else self.choice(index, prefix, delta=True)

    def logprobs(self, lps: list[TokenLogprob], offsets: list[int], base: int) -> dict:
        """tokens, token_logprobs, top_logprobs (the top n plus the chosen token, as OpenAI and vLLM
        return it), text_offset (`base` + characters into the choice's text)."""
        def top(tl):
            d = {self.token_text(t)[0]: _lp(v) for t, v in tl.top}
            d.setdefault(self.token_text(tl.token_id)[0], _lp(tl.logprob))
            return d
        return {"tokens": [self.token_text(tl.token_id)[0] for tl in lps],
                "token_logprobs": [_lp(tl.logprob) for tl in lps], "top_logprobs": [top(tl) for tl in lps],
                "text_offset": [base + o for o in offsets]}


class ChatApi(Api):
    """`/v1/chat/completions`: a whole choice carries `message`, a streamed one `delta` (opening with
    the assistant role); logprobs in the chat format (token, logprob, bytes, top_logprobs)."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix, prompt_param = "chatcmpl", "messages"

    def content(self, text: str, delta: bool, calls: list[dict] | None = None) -> dict:
        if delta:
            return {"delta": ({"content": text} if text else {}) | ({"tool_calls": calls} if calls else {})}
        if calls:  # a tool-calling choice: content is the text outside the calls (None when there is none)
            return {"message": {"role": "assistant", "content": text or None, "tool_calls": calls}}
        return {"message": {"role": "assistant", "content": text}}

    def opening(self, index: int, prefix: str | None) -> dict | None:
        return self.choice(index, "", delta=True) | {"delta": {"role": "assistant", "content": ""}}

    def logprobs(self, lps: list[TokenLogprob], offsets: list[int], base: int) -> dict:
        def entry(t, v):
            s, b = self.token_text(t)
            return {"token": s, "logprob": _lp(v), "bytes": list(b)}
        return {"content": [entry(tl.token_id, tl.logprob) | {"top_logprobs": [entry(t, v) for t, v in tl.top]}
                            for tl in lps], "refusal": None}


def envelope(api: Api, request_id: str, created: int, model: str, choices: list[dict], *, chunk: bool = False,
             **fields) -> dict:
    """The one response envelope, of a whole response (`chunk` False) and of each streamed chunk:
    id `<api.id_prefix>-<request_id>`, object, `created` (Unix time, s), model, choices, then
    `fields` (usage, tidespec) in the order given."""
    return {"id": f"{api.id_prefix}-{request_id}", "object": api.chunk_object if chunk else api.object,
            "created": created, "model": model, "choices": choices, **fields}
