"""Structured output and tool calls for `/v1/chat/completions`: the request's `response_format`
(`json_object`, `json_schema`) or `tools` + `tool_choice` are checked (`build`: JSON Schema 2020-12
meta-schema, `$ref` cycles, names) and turned into the canonical constraint spec and its grammar
(`engine.constraint`: the spec, the grammar, the tool-call format), and a tool-calling completion
is streamed as `delta.tool_calls` (`ToolCallStream`). `tool_choice: none` means no constraint (the
tools are still shown to the target).

Errors are `OpenAIError` 400s naming the field (`response_format…`, `tools[i].function.parameters`,
`tool_choice`, `min_tokens`) and the reason.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from ..engine.constraint import (ANY_OBJECT, CLOSE, OPEN, grammar_for, kind_of, new_call_id, parse_tool_calls, render,
                                 spec_of_request)
from ..engine.grammar import Grammar, GrammarCompiler, GrammarError, schema_key
from .errors import OpenAIError

__all__ = ["Constraint", "ToolCallStream", "build", "check_schema", "parse_tool_calls", "render"]


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


def _compile(spec: dict, compiler: GrammarCompiler, param: str) -> Grammar:
    try:
        return grammar_for(spec, compiler)
    except GrammarError as e:
        raise OpenAIError(f"{param} cannot be compiled into a grammar: {str(e).splitlines()[0]}", param=param) from None


def build(body, compiler: GrammarCompiler | None) -> Constraint | None:
    """The request's constraint (None: unconstrained). Raises OpenAIError 400 naming the field."""
    rf = body.response_format
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
    use_tools = bool(tools) and choice != "none"
    if rf is not None and rf.type != "text" and use_tools:
        raise OpenAIError("response_format json_object/json_schema and tool calls cannot both constrain one "
                          "completion; send tool_choice: none, or drop response_format", param="response_format")
    for i, t in enumerate(tools):
        check_schema(t["function"].get("parameters") or ANY_OBJECT, f"tools[{i}].function.parameters")
    if (rf is None or rf.type == "text") and not use_tools:
        return None
    param = "tools" if use_tools else "response_format"
    if compiler is None:
        raise OpenAIError("structured output needs the target's tokenizer; this server has none", param=param)
    if body.min_tokens:
        raise OpenAIError("min_tokens cannot be combined with response_format or tools (it would mask the end "
                          "the grammar requires)", param="min_tokens")
    if not use_tools and rf.type == "json_schema":
        param = "response_format.json_schema.schema"
        check_schema(rf.json_schema.schema_, param)
    spec = spec_of_request({"tools": tools, "tool_choice": choice, "parallel_tool_calls": body.parallel_tool_calls,
                            "response_format": rf.model_dump(by_alias=True, exclude_none=True) if rf else None})
    return Constraint(_compile(spec, compiler, param), kind_of(spec), spec, schema_key(spec), tools=use_tools)


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
