"""Structured output and tool calls for `/v1/chat/completions`: OpenAI's `response_format`
(`json_object`, `json_schema`) and `tools` + `tool_choice` become one grammar (`engine.grammar`)
that constrains the whole completion, so even a small target emits valid JSON and valid calls.

Tool-call format. SmolLM2-Instruct's chat template renders no tools, so tidespec uses one documented
fallback, the Hermes-style format Qwen2.5 and NousResearch's Hermes models are trained on (vLLM's
`hermes` tool parser reads it): the tools' JSON schemas go into the system message, and a call is
`<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, calls separated by a newline.
Assistant messages carrying `tool_calls` are rendered back in that format; `tool` messages keep
their role. The grammar per `tool_choice`: `required` — one or more calls (exactly one with
`parallel_tool_calls: false`); a named function — one call of it; `auto` — either text that does
not start with `<` or calls; `none` — no constraint (the tools are still shown). JSON is compact
(`", "` / `": "`), as `engine.grammar` compiles it, which is what `ToolCallStream` relies on.

Errors are `OpenAIError` 400s naming the field (`response_format`, `tools[i].function.parameters`,
`tool_choice`, `min_tokens`) and the reason.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from ..engine.grammar import JSON_OPTIONS, Grammar, GrammarCompiler, GrammarError, schema_key
from .errors import OpenAIError

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
ANY_OBJECT = {"type": "object"}
_CALL_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


@dataclass(frozen=True)
class Constraint:
    """A chat request's grammar. kind: "json_object", "json_schema" or "tools"; spec: the request's
    constraint fields as sent (what capture keeps); key: `schema_key(spec)`; tools: the completion
    holds tool calls to parse (`tool_choice` not none)."""

    grammar: Grammar
    kind: str
    spec: dict
    key: str
    tools: bool = False


def check_schema(schema, param: str) -> dict:
    """A JSON schema (Draft 2020-12 meta-schema) or OpenAIError 400 naming `param`."""
    if not isinstance(schema, dict):
        raise OpenAIError(f"{param} must be a JSON schema object", param=param)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise OpenAIError(f"{param} is not a valid JSON schema{f' at {where}' if where else ''}: {e.message}",
                          param=param) from None
    cycle = _ref_cycle(schema)
    if cycle:
        raise OpenAIError(f"{param} has a $ref cycle that never produces a value: {' -> '.join(cycle)}", param=param)
    return schema


def _ref_cycle(schema: dict) -> list[str]:
    """A chain of local `$ref`s that returns to itself with nothing in between (`a` → `b` → `a`), or []
    (recursion through properties or items is a valid recursive schema, not a cycle)."""
    def resolve(ref: str):
        node = schema
        for part in ref.removeprefix("#").strip("/").split("/") if ref != "#" else []:
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    def walk(node):
        if isinstance(node, dict):
            yield node
            for v in node.values():
                yield from walk(v)
        elif isinstance(node, list):
            for v in node:
                yield from walk(v)

    for node in walk(schema):
        seen, cur = [], node
        while isinstance(cur, dict) and isinstance(cur.get("$ref"), str) and cur["$ref"].startswith("#"):
            if cur["$ref"] in seen:
                return seen[seen.index(cur["$ref"]):] + [cur["$ref"]]
            seen.append(cur["$ref"])
            cur = resolve(cur["$ref"])
    return []


def _compile(fn, arg, param: str) -> Grammar:
    try:
        return fn(arg)
    except GrammarError as e:
        raise OpenAIError(f"{param} cannot be compiled into a grammar: {str(e).splitlines()[0]}", param=param) from None


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


def build(body, compiler: GrammarCompiler | None) -> Constraint | None:
    """The request's constraint (None: unconstrained). Raises OpenAIError 400 naming the field."""
    rf = body.response_format
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
    use_tools = bool(tools) and choice != "none"
    if rf is not None and rf.type != "text" and use_tools:
        raise OpenAIError("response_format json_object/json_schema and tool calls cannot both constrain one "
                          "completion; send tool_choice: none, or drop response_format", param="response_format")
    if (rf is None or rf.type == "text") and not use_tools:
        for i, t in enumerate(tools):
            check_schema(t["function"].get("parameters") or ANY_OBJECT, f"tools[{i}].function.parameters")
        return None
    if compiler is None:
        raise OpenAIError("structured output needs the target's tokenizer; this server has none",
                          param="tools" if use_tools else "response_format")
    if body.min_tokens:
        raise OpenAIError("min_tokens cannot be combined with response_format or tools (it would mask the end "
                          "the grammar requires)", param="min_tokens")
    if use_tools:
        for i, t in enumerate(tools):
            check_schema(t["function"].get("parameters") or ANY_OBJECT, f"tools[{i}].function.parameters")
        parallel = body.parallel_tool_calls is not False
        spec = {"tools": tools, "tool_choice": choice or "auto", "parallel_tool_calls": parallel}
        g = _compile(compiler.lark, tools_grammar(tools, choice or "auto", parallel), "tools")
        return Constraint(g, "tools", spec, schema_key(spec), tools=True)
    if rf.type == "json_object":
        spec = {"response_format": {"type": "json_object"}}
        return Constraint(_compile(compiler.json_schema, ANY_OBJECT, "response_format"), "json_object", spec,
                          schema_key(spec))
    js = rf.json_schema
    schema = check_schema(js.schema_, "response_format.json_schema.schema")
    spec = {"response_format": rf.model_dump(by_alias=True, exclude_none=True)}
    return Constraint(_compile(compiler.json_schema, schema, "response_format.json_schema.schema"), "json_schema",
                      spec, schema_key(spec))


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


def new_call_id() -> str:
    """A tool call id (OpenAI's `call_` + 24 characters)."""
    return "call_" + uuid.uuid4().hex[:24]


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a completion: every `<tool_call>` block that parses becomes an
    OpenAI tool call (`arguments` a JSON string); content is the text outside them (None if empty)."""
    calls = []
    for m in _CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
            calls.append({"id": new_call_id(), "type": "function", "function": {
                "name": obj["name"], "arguments": json.dumps(obj["arguments"], separators=(", ", ": "))}})
        except (ValueError, KeyError, TypeError):
            return (text or None), []  # an unfinished call (finish_reason length): the text as it is
    rest = _CALL_RE.sub("", text).strip() if calls else text
    return (rest or None), calls


@dataclass
class ToolCallStream:
    """Turns a constrained completion's streamed text into OpenAI `delta`s as vLLM streams calls: per
    call, one delta with its index, id, type and name (`arguments: ""`), then the arguments' text in
    pieces as it is generated. Text that is not a call streams as `content`. `feed(text)` returns
    (content piece, tool-call delta entries) for the new text; `calls` counts calls opened."""

    buf: str = ""
    pos: int = 0  # characters of buf handled
    calls: int = 0
    state: str = "text"  # text | head (before the name's end) | args | tail (after the arguments)
    depth: int = 0
    in_str: bool = False
    esc: bool = False
    _name_at: int = field(default=0, repr=False)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """The content piece and tool-call delta entries of `text` (the next piece of the completion);
        `final`: the completion ends here (held-back text is released as content)."""
        self.buf += text
        content, out = "", []
        while self.pos < len(self.buf):
            rest = self.buf[self.pos:]
            if self.state == "text":
                at = rest.find(OPEN)
                if at < 0:  # hold back what may still become "<tool_call>\n"
                    keep = 0 if final else next((n for n in range(min(len(OPEN) - 1, len(rest)), 0, -1)
                                                 if OPEN.startswith(rest[-n:])), 0)
                    content += rest[:len(rest) - keep]
                    self.pos += len(rest) - keep
                    break
                content += rest[:at]
                self.pos += at + len(OPEN)
                self.state, self._name_at = "head", self.pos
            elif self.state == "head":
                m = re.match(r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": ', rest)
                if m is None:
                    break
                out.append({"index": self.calls, "id": new_call_id(), "type": "function",
                            "function": {"name": json.loads(f'"{m.group(1)}"'), "arguments": ""}})
                self.pos += m.end()
                self.state, self.depth, self.in_str, self.esc = "args", 0, False, False
            elif self.state == "args":
                n = self._scan(rest)
                if n:
                    out.append({"index": self.calls, "function": {"arguments": rest[:n]}})
                    self.pos += n
                if self.state == "args":
                    break
            else:  # tail: "}" + CLOSE (+ "\n" before the next call)
                end = rest.find(CLOSE)
                if end < 0:
                    break
                self.pos += end + len(CLOSE)
                self.calls += 1
                if self.buf[self.pos:self.pos + 1] == "\n":
                    self.pos += 1
                self.state = "text"
        return content, out

    def _scan(self, s: str) -> int:
        """Characters of `s` that belong to the arguments' JSON value; moves to `tail` at its end."""
        for i, ch in enumerate(s):
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
                continue
            if ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.state = "tail"
                    return i + 1
        return len(s)
