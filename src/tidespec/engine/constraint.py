"""A request's constraint: OpenAI's `response_format` / `tools` + `tool_choice` as a canonical spec,
the grammar it compiles to (`engine.grammar`), and the tool-call format around it.

The spec is what a constrained request carries everywhere after the server checked it — the engine
request's grammar is compiled from it, a captured record keeps it (with its `schema_key`), replay and
evaluation compile the same grammar from it — so a request is constrained the same way when it is
served, replayed and evaluated. Spec shapes (`grammar_for`):
`{"response_format": {"type": "json_object"}}`,
`{"response_format": {"type": "json_schema", "json_schema": {"name", "schema", "strict"?}}}`,
`{"tools": [OpenAI tool, ...], "tool_choice": "auto" | "required" | {"type": "function", "function":
{"name"}}, "parallel_tool_calls": bool}`.

Tool-call format. SmolLM2-Instruct's chat template renders no tools, so tidespec uses one documented
fallback, the Hermes-style format Qwen2.5 and NousResearch's Hermes models are trained on (vLLM's
`hermes` tool parser reads it): the tools' JSON schemas go into the system message (`render`), and a
call is `<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>`, calls separated by a
newline (`parse_tool_calls`). The grammar per `tool_choice`: `required` — one or more calls (exactly
one with `parallel_tool_calls: false`); a named function — one call of it; `auto` — either text that
does not start with `<` or calls. JSON is compact (`", "` / `": "`, `engine.grammar.JSON_OPTIONS`).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import replace

from .grammar import JSON_OPTIONS, Grammar, GrammarCompiler

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
ANY_OBJECT = {"type": "object"}
_ARGS = '", "arguments": '  # between a call's name and its arguments (compact JSON)
_CALL_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


def spec_of_request(body: dict) -> dict | None:
    """The constraint spec of an OpenAI chat request body (a dict, as sent or logged): its non-text
    `response_format`, or its `tools` with `tool_choice` (default "auto") and `parallel_tool_calls`
    (default true) unless `tool_choice` is "none"; None for an unconstrained request. The server
    checks the body first (`serve.structured.build`); text capture's ingest reads logged bodies."""
    rf, tools, choice = body.get("response_format"), body.get("tools"), body.get("tool_choice")
    if tools and choice != "none":
        return {"tools": tools, "tool_choice": choice or "auto",
                "parallel_tool_calls": body.get("parallel_tool_calls") is not False}
    if isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema"):
        return {"response_format": rf}
    return None


def kind_of(spec: dict) -> str:
    """"json_object", "json_schema" or "tools"."""
    return "tools" if "tools" in spec else spec["response_format"]["type"]


def grammar_for(spec: dict, compiler: GrammarCompiler) -> Grammar:
    """The grammar of a constraint spec (module docstring). Raises GrammarError when it cannot be
    compiled, KeyError / TypeError for a malformed spec. The grammar carries the spec (`Grammar.spec`)."""
    if "tools" in spec:
        g = compiler.lark(tools_grammar(spec["tools"], spec.get("tool_choice", "auto"),
                                        spec.get("parallel_tool_calls", True)))
    else:
        rf = spec["response_format"]
        g = compiler.json_schema(ANY_OBJECT if rf["type"] == "json_object" else rf["json_schema"]["schema"])
    return replace(g, spec=spec)


def call_schema(tools: list[dict]) -> dict:
    """The schema of one call: `{"name": const, "arguments": parameters}` for each of `tools`."""
    alts = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                              "arguments": t["function"].get("parameters") or ANY_OBJECT},
             "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return alts[0] if len(alts) == 1 else {"anyOf": alts}


def tools_grammar(tools: list[dict], choice, parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect) of a completion under `tool_choice` `choice`."""
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    allowed = [t for t in tools if t["function"]["name"] == named] if named else tools
    schema = call_schema(allowed) | {"x-guidance": JSON_OPTIONS}  # compact JSON, as `engine.grammar` compiles it
    call = f'call: "<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"'
    calls = "calls: call" if named or not parallel else 'calls: call ("\\n" call)*'
    start = "start: calls | TEXT\nTEXT: /[^<][\\s\\S]*/" if choice == "auto" else "start: calls"
    return "\n".join([start, calls, call])


def tools_system_text(tools: list[dict]) -> str:
    """The system-message block that shows the tools and the call format to the target."""
    lines = "\n".join(json.dumps(t["function"], separators=(", ", ": ")) for t in tools)
    return ("You can call functions. Their signatures, as JSON schemas:\n<tools>\n" + lines + "\n</tools>\n"
            "To call one, answer with <tool_call>\n{\"name\": <function name>, \"arguments\": <arguments as a "
            "JSON object>}\n</tool_call> (one block per call).")


def render(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Chat-template messages with the tools in the system message (a new first one if there is
    none) and assistant `tool_calls` rendered as call blocks after their content."""
    out = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            blocks = [OPEN + json.dumps({"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
                                        separators=(", ", ": ")) + CLOSE for c in calls]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        out.append(m)
    if tools:
        text = tools_system_text(tools)
        if out and out[0]["role"] == "system":
            out[0] = out[0] | {"content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def call_text(content: str | None, calls: list[dict]) -> str:
    """The completion text of a reply with tool calls (the inverse of `parse_tool_calls`): the content,
    then one `<tool_call>` block per call (`{"name", "function": {"name", "arguments"}}` entries,
    arguments as the JSON string they came as), newline-separated."""
    blocks = [OPEN + '{"name": ' + json.dumps(c["function"]["name"])[:-1] + _ARGS + c["function"]["arguments"] + "}"
              + CLOSE
              for c in calls]
    return "\n".join(([content] if content else []) + blocks)


def new_call_id() -> str:
    """A tool call id (OpenAI's `call_` + 24 characters)."""
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a completion: every `<tool_call>` block that parses becomes an
    OpenAI tool call whose `arguments` is the generated JSON text verbatim (so `call_text` gives the
    completion back); content is the text outside them (None if empty)."""
    calls = []
    for m in _CALL_RE.finditer(text):
        try:
            obj, body = json.loads(m.group(1)), m.group(1)
            at = body.index(_ARGS) + len(_ARGS)
            if not isinstance(obj["arguments"], dict) or json.loads(body[at:-1]) != obj["arguments"]:
                raise ValueError("not the compact layout")
            calls.append({"id": new_call_id(), "type": "function",
                          "function": {"name": obj["name"], "arguments": body[at:-1]}})
        except (ValueError, KeyError, TypeError):
            return (text or None), []  # an unfinished call (finish_reason length): the text as it is
    rest = _CALL_RE.sub("", text).strip() if calls else text
    return (rest or None), calls
