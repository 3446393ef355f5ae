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

from dataclasses import dataclass

from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from ..engine.constraint import (
    ANY_OBJECT,
    ToolCallStream,
    grammar_for,
    kind_of,
    parse_tool_calls,
    render,
    spec_of_request,
)
from ..engine.grammar_state import Grammar, GrammarCompiler, GrammarError, schema_key
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
    """A JSON schema — checked against the meta-schema its `$schema` names (default 2020-12; `pattern`
    regexes are left to the grammar library, which reads ECMA-262) and for `$ref` cycles — or
    OpenAIError 400 naming `param`."""
    if not isinstance(schema, dict):
        raise OpenAIError(f"{param} must be a JSON schema object", param=param)
    try:
        validator_for(schema).check_schema(schema, format_checker=None)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise OpenAIError(f"{param} is not a valid JSON schema{f' at {where}' if where else ''}: {e.message}",
                          param=param) from None
    except RecursionError:
        raise OpenAIError(f"{param} is nested too deeply", param=param) from None
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

    done: set[str] = set()  # refs whose chain ends in a schema that is not a bare $ref
    for node in walk(schema):
        seen, cur = [], node
        while isinstance(cur, dict) and isinstance(cur.get("$ref"), str) and cur["$ref"].startswith("#"):
            ref = cur["$ref"]
            if ref in done:
                break
            if ref in seen:
                return seen[seen.index(ref):] + [ref]
            seen.append(ref)
            cur = resolve(ref)
        done.update(seen)
    return []


def _compile(spec: dict, compiler: GrammarCompiler, param: str) -> Grammar:
    try:
        return grammar_for(spec, compiler)
    except GrammarError as e:
        raise OpenAIError(f"{param} cannot be compiled into a grammar: {str(e).splitlines()[0]}", param=param) from None


# fields that cannot be combined with a grammar, and why
_NOT_WITH_GRAMMAR = {"min_tokens": "it would mask the end the grammar requires",
                     "stop": "a stop string would cut the constrained output",
                     "stop_token_ids": "a stop token would cut the constrained output",
                     "ignore_eos": "the grammar's end is an EOS; generating past it only adds hidden EOS tokens"}


def build(body, compiler: GrammarCompiler | None) -> Constraint | None:
    """The request's constraint (None: unconstrained). Raises OpenAIError 400 naming the field."""
    rf = body.response_format
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    choice = body.tool_choice.model_dump() if hasattr(body.tool_choice, "model_dump") else body.tool_choice
    use_tools = bool(tools) and choice != "none"
    if rf is not None and rf.type != "text" and use_tools:
        raise OpenAIError("response_format json_object/json_schema and tool calls cannot both constrain one "
                          "completion; send tool_choice: none, or drop response_format", param="response_format")
    _check_tools(tools)
    if (rf is None or rf.type == "text") and not use_tools:
        return None
    param = "tools" if use_tools else "response_format"
    if compiler is None:
        raise OpenAIError("structured output needs the target's tokenizer; this server has none", param=param)
    for name, why in _NOT_WITH_GRAMMAR.items():
        if getattr(body, name):
            raise OpenAIError(f"{name} cannot be combined with response_format or tools: {why}", param=name)
    if use_tools:
        _compile_tools(tools, compiler)
    elif rf.type == "json_schema":
        param = "response_format.json_schema.schema"
        check_schema(rf.json_schema.schema_, param)
        if rf.json_schema.strict:
            check_strict(rf.json_schema.schema_, param)
    spec = spec_of_request({"tools": tools, "tool_choice": choice, "parallel_tool_calls": body.parallel_tool_calls,
                            "response_format": rf.model_dump(by_alias=True, exclude_none=True) if rf else None})
    return Constraint(_compile(spec, compiler, param), kind_of(spec), spec, schema_key(spec), tools=use_tools)


def _check_tools(tools: list[dict]) -> None:
    """Each tool's parameters: a valid JSON schema of an object. Raises OpenAIError naming the tool."""
    for i, t in enumerate(tools):
        param = f"tools[{i}].function.parameters"
        params = check_schema(t["function"].get("parameters") or ANY_OBJECT, param)
        if params.get("type", "object") != "object":
            raise OpenAIError(f"{param} must describe a JSON object (type \"object\"), got type "
                              f"{params.get('type')!r}", param=param)
        if t["function"].get("strict"):
            check_strict(params, param)


# where schemas nest: keyword → its value is a schema, a list of schemas, or a map of schemas
_SUB = {"items": "one", "additionalProperties": "one", "not": "one", "contains": "one", "prefixItems": "list",
        "anyOf": "list", "oneOf": "list", "allOf": "list", "properties": "map", "$defs": "map",
        "definitions": "map", "patternProperties": "map"}


def check_strict(schema: dict, param: str) -> None:
    """`strict: true` as OpenAI's strict mode means it: every object schema closed —
    `"additionalProperties": false` and every property in `required` (the OpenAI SDK's `parse`
    writes schemas so). Raises OpenAIError 400 naming `param`, the JSON pointer of the first object
    that is not, and the fix (close it, or send strict: false); an open object would let the model
    fill keys the schema never named."""
    def walk(node, path: str):
        if not isinstance(node, dict):
            return
        if node.get("type") == "object" or "properties" in node:
            props = node.get("properties", {})
            missing = [k for k in props if k not in node.get("required", [])]
            if node.get("additionalProperties") is not False or missing:
                what = ('"additionalProperties": false' if node.get("additionalProperties") is not False
                        else f"{', '.join(map(repr, missing))} in \"required\"")
                raise OpenAIError(f"{param}: strict: true means closed objects (OpenAI's strict mode: "
                                  f"\"additionalProperties\": false and every property required); the object at "
                                  f"{path or '/'} needs {what}. Close it, or send strict: false", param=param)
        for key, kind in _SUB.items():
            sub = node.get(key)
            if kind == "one":
                walk(sub, f"{path}/{key}")
            elif kind == "list" and isinstance(sub, list):
                for i, v in enumerate(sub):
                    walk(v, f"{path}/{key}/{i}")
            elif kind == "map" and isinstance(sub, dict):
                for k, v in sub.items():
                    walk(v, f"{path}/{key}/{k}")
    walk(schema, "")


def _compile_tools(tools: list[dict], compiler: GrammarCompiler) -> None:
    """Each tool's arguments grammar alone (a call grammar embeds the same), so an error names its tool."""
    for i, t in enumerate(tools):
        try:
            compiler.json_schema(t["function"].get("parameters") or ANY_OBJECT)
        except GrammarError as e:
            raise OpenAIError(f"tools[{i}].function.parameters cannot be compiled into a grammar: "
                              f"{str(e).splitlines()[0]}", param=f"tools[{i}].function.parameters") from None
