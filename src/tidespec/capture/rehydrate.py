"""Rebuild capture records from logged text: production endpoints (SageMaker/SGLang/vLLM) log the
request and the response *text*, not the engine's tensors.

One prefill of prompt + response through the target gives the record the embedded engine would
have captured live (`Engine._finish`): the same input_ids / loss_mask, and hidden states equal up to
fp32 rounding (the live path runs the prompt in one block and later rows one step or one verify
block at a time; attention and small-M GEMMs over other block sizes round differently: measured
max |diff| 6e-7 on the tiny test target, 4e-4 on SmolLM2-135M, ~0.15 % of the generated rows' elements
differ after the bf16 storage cast; tests/test_rehydrate.py). Exact only when the response text
re-tokenises to the ids the engine produced (true for ordinary text; decode/encode is not a bijection).
"""
from __future__ import annotations

import torch

from ..engine.constraint import render
from ..engine.grammar_state import Grammar
from ..engine.sampling import GREEDY, SamplingParams
from ..engine.speculative import Engine, Request
from ..models.chat import chat_ids
from ..models.target import Segment, Target

_ROUTES = {"chat": "chat", "/v1/chat/completions": "chat", "completions": "completions",
           "/v1/completions": "completions"}
_ROLES = ("system", "user", "assistant", "tool")  # what `tidespec serve` accepts (serve.protocol.ChatMessage)


def _is_ids(x) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _content(m, i: int, part_sep: str) -> str:
    c = m.get("content") if isinstance(m, dict) else None
    if isinstance(c, str):
        return c
    if c is None and m.get("role") == "assistant" and m.get("tool_calls"):
        return ""
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        return part_sep.join(p["text"] for p in c)
    raise ValueError(f"messages[{i}].content must be a string or a list of {{'type': 'text', 'text': ...}} parts "
                     "(images, audio and other parts are unsupported)")


def request_prompt_ids(tok, route: str, request: dict, *, part_sep: str = "\n") -> list[int]:
    """Prompt ids `list[int]` exactly as `tidespec serve` builds them for `request` (a logged body).

    route "chat" (or "/v1/chat/completions"): `request["messages"]` (roles system/user/assistant,
    content a string or a list of text parts joined with `part_sep`, "\\n" as vLLM joins them)
    through the chat template with the generation prompt. route "completions" (or
    "/v1/completions"): `request["prompt"]` as text (tokenised without special tokens) or as token
    ids; a one-element list is that one prompt. Raises ValueError naming what is unsupported: an
    unknown route, a batch of several prompts, an empty prompt, a missing/malformed field, a text
    prompt without a tokenizer, a chat without a chat template.
    """
    kind = _ROUTES.get(route)
    if kind is None:
        raise ValueError(f"unsupported route {route!r}: use 'chat' or 'completions'")
    if not isinstance(request, dict):
        raise ValueError("request must be the logged JSON body (a dict)")
    if kind == "chat":
        msgs = request.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("chat request without messages: 'messages' must be a non-empty list")
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("chat request needs a tokenizer with a chat template")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in _ROLES:
                raise ValueError(f"messages[{i}]: unsupported role {m.get('role') if isinstance(m, dict) else m!r}; "
                                 f"tidespec serve accepts {_ROLES}")
        msgs = [{"role": m["role"], "content": _content(m, i, part_sep)}
                | ({"tool_calls": m["tool_calls"]} if m.get("tool_calls") else {}) for i, m in enumerate(msgs)]
        if request.get("tools") or any("tool_calls" in m for m in msgs):  # as `tidespec serve` renders them
            msgs = render(msgs, request.get("tools"))
        return chat_ids(tok, msgs, True)
    p = request.get("prompt")
    if isinstance(p, list) and p and not _is_ids(p):  # OpenAI batch form: a list of prompts
        if len(p) != 1:
            raise ValueError(f"a batch of {len(p)} prompts is unsupported: log one prompt per exchange")
        p = p[0]
    if isinstance(p, str):
        if tok is None:
            raise ValueError("text prompt needs a tokenizer: pass the target's tokenizer or log token ids")
        p = list(tok(p, add_special_tokens=False)["input_ids"])
    if not _is_ids(p) or not p:
        raise ValueError("completions request needs 'prompt': a non-empty string or list of token ids")
    return list(p)


def completion_ids(tok, text: str, finish_reason: str | None, eos_id: int) -> list[int]:
    """Generated ids `list[int]` the live engine produced for a response `text`: the text's ids
    (no special tokens) plus `eos_id` when finish_reason is "stop" or "tool_calls" (`Generation.tokens`
    keeps the EOS the response text omits; "stop" of a request without stop strings means EOS; the
    text of a tool-calling reply is its calls in the tool-call format, `engine.constraint.call_text`).
    finish_reason "length" or None (unknown): the text's ids only. Raises ValueError for another
    finish_reason (e.g. "abort", "content_filter") or a non-string text.
    """
    if finish_reason not in ("stop", "tool_calls", "length", None):
        raise ValueError(
            f"unsupported finish_reason {finish_reason!r}: expected 'stop', 'tool_calls', 'length' or None"
        )
    if not isinstance(text, str):
        raise ValueError(f"response text must be a string, got {type(text).__name__}")
    ids = list(tok(text, add_special_tokens=False)["input_ids"]) if text else []
    return ids + [int(eos_id)] if finish_reason in ("stop", "tool_calls") else ids


def check_exchange(target: Target, prompt_ids: list[int], gen_ids: list[int]) -> list[int]:
    """The ids one prefill runs for an exchange: `prompt + gen[:-1]` (the last generated token is
    never fed back). Raises ValueError for an empty prompt or generation, ids outside the vocab, or
    prompt + gen longer than the target context (`cfg.max_position`)."""
    p, g = list(prompt_ids), list(gen_ids)
    if not p:
        raise ValueError("empty prompt: nothing to condition on")
    if not g:
        raise ValueError("empty generation: no response to rehydrate; regenerate it (`regenerate`) "
                         "and mark the record regenerated, or drop the exchange")
    n, cap, V = len(p) + len(g), target.cfg.max_position, target.cfg.vocab_size
    if n > cap:
        raise ValueError(f"prompt ({len(p)}) + generation ({len(g)}) = {n} tokens exceeds the target context "
                         f"max_position {cap}; truncate the generation to {max(cap - len(p), 0)} tokens or drop "
                         "the exchange")
    if not all(isinstance(t, int) and 0 <= t < V for t in p + g):
        raise ValueError(f"token ids must be integers in [0, {V})")
    return p + g[:-1]


def make_record(ids: list[int], n_prompt: int, aux: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A capture record: input_ids `[T]` int32, loss_mask `[T]` uint8 (1 from `n_prompt` on), the
    given aux_hidden_states `[T, 3H]` and hidden_states `[T, H]` (final, post-norm); without them,
    a tokens-only record (`ingest.mode: online`)."""
    mask = torch.zeros(len(ids), dtype=torch.uint8)
    mask[n_prompt:] = 1
    rec = {"input_ids": torch.tensor(ids, dtype=torch.int32), "loss_mask": mask}
    return rec if aux is None else rec | {"aux_hidden_states": aux, "hidden_states": hidden}


def token_record(target: Target, prompt_ids: list[int], gen_ids: list[int]) -> dict[str, torch.Tensor]:
    """The tokens-only record of an exchange (`ingest.mode: online`): `rehydrate`'s input_ids and
    loss_mask, no prefill. Raises ValueError as `check_exchange`."""
    return make_record(check_exchange(target, prompt_ids, gen_ids), len(prompt_ids))


def exchange_of(record: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """The exchange (prompt ids, generated ids) that `rehydrate` turns back into `record`'s ids and
    mask: the prompt is the loss_mask == 0 prefix; the generation is the rest plus a stand-in for
    its last token, which a record never holds (it is never fed back; the stand-in repeats the
    last id, so the exchange has its original length). Raises ValueError when the mask is not a
    prompt prefix of 0s followed by 1s (a record `rehydrate` could not have made)."""
    ids, mask = record["input_ids"].tolist(), record["loss_mask"].tolist()
    n = mask.index(1) if 1 in mask else len(mask)
    if n == 0 or n == len(mask) or any(m != 1 for m in mask[n:]):
        raise ValueError(f"loss_mask {mask[:8]}... is not a prompt (0s) then a generation (1s): this record "
                         "cannot be rehydrated")
    return ids[:n], ids[n:] + ids[-1:]


def rehydrate(target: Target, prompt_ids: list[int], gen_ids: list[int]) -> dict[str, torch.Tensor]:
    """The capture record of an exchange, from one prefill of `prompt + gen[:-1]` (fresh KV cache).

    Returns, with T = len(prompt) + len(gen) - 1 (the last generated token is never fed back):
    input_ids `[T]` int32, loss_mask `[T]` uint8 (1 from len(prompt) on), aux_hidden_states
    `[T, 3H]` and hidden_states `[T, H]` in the target dtype (fp32 by default): the live record
    before the writer's bf16 cast. Raises ValueError as `check_exchange`.
    """
    ids = check_exchange(target, prompt_ids, gen_ids)
    T = len(ids)
    out = target.forward_batch([Segment(torch.tensor(ids, dtype=torch.int64), target.new_cache(T), last_only=True)],
                               need_hidden=True)[0]
    return make_record(ids, len(prompt_ids), out.aux.cpu(), out.hidden.cpu())


def regenerate(engine: Engine, prompt_ids: list[int], max_new_tokens: int,
               sampling: SamplingParams = GREEDY, grammar: Grammar | None = None) -> list[int]:
    """The target's own response `list[int]` (speculative=False, not captured) for an exchange
    logged without one — under the request's grammar when it was constrained; the caller marks the
    record `regenerated`. Ends with the EOS id when it stopped there, as `Generation.tokens`. Raises
    ValueError as `Engine.validate` (empty prompt, prompt + max_new_tokens beyond engine.max_seq_len, ...)."""
    req = Request(list(prompt_ids), max_new_tokens, speculative=False, capture=False, sampling=sampling,
                  grammar=grammar)
    return list(engine.generate_batch([req])[0].tokens)


__all__ = ["check_exchange", "completion_ids", "exchange_of", "make_record", "regenerate", "rehydrate",
           "request_prompt_ids", "token_record"]
