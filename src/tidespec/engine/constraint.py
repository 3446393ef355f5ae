"""A request's constraint: OpenAI's `response_format` / `tools` + `tool_choice` as a canonical spec,
the grammar it compiles to (`grammar_for`), and the tool-call format around it.

The spec travels with the request everywhere after the server checked it (captured with the
record, replayed and evaluated under the same grammar). Tools use the Hermes-style format (the
schemas in the system message, each call a `{"name", "arguments"}` object between `<tool_call>` lines): the
target's chat template renders no tools. `tool_choice` `required` = one or more calls, a named
function = one call of it, `auto` = text or calls. Spec shapes in full: docs/design/engine.md.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace

from .grammar_state import JSON_OPTIONS, Grammar, GrammarCompiler, annotation_formats_dropped

OPEN, CLOSE = "<tool_call>\n", "\n</tool_call>"
ANY_OBJECT = {"type": "object"}
_ARGS = '", "arguments": '  # between a call's name and its arguments (compact JSON)


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


def _lark_str(text: str) -> str:
    """A Lark string literal for `text` (JSON's escapes)."""
    return json.dumps(text)


def tools_grammar(tools: list[dict], choice, parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect) of a completion under `tool_choice` `choice`: per tool,
    its call's fixed text (`<tool_call>\n{"name": NAME, "arguments": `) then its arguments as a JSON
    value of its own `parameters` schema (its own root, so `$ref`s — `#`, `#/$defs/…` — resolve as the
    client wrote them), then `}\n</tool_call>`."""
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    allowed = [t for t in tools if t["function"]["name"] == named] if named else tools
    rules = []
    for i, t in enumerate(allowed):
        params = annotation_formats_dropped(t["function"].get("parameters") or ANY_OBJECT) | {
            "x-guidance": JSON_OPTIONS}  # compact JSON
        head = OPEN + '{"name": ' + json.dumps(t["function"]["name"])[:-1] + _ARGS
        rules += [
            f"call_{i}: {_lark_str(head)} args_{i} {_lark_str('}' + CLOSE)}",
            f"args_{i}: %json {json.dumps(params)}",
        ]
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(allowed)))
    calls = "calls: call" if named or not parallel else r'calls: call ("\n" call)*'  # Lark's "\n": a newline
    start = "start: calls | TEXT\n" + r"TEXT: /[^<][\s\S]*/" if choice == "auto" else "start: calls"
    return "\n".join([start, calls, call, *rules])


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
            blocks = [
                OPEN
                + json.dumps(
                    {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
                    separators=(", ", ": "),
                )
                + CLOSE
                for c in calls
            ]
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
    """(content, tool calls) of a whole completion, exactly as `ToolCallStream` streams it: a
    completion that starts with `<tool_call>` is calls (each `arguments` the generated JSON text
    verbatim, so `call_text` gives the completion back; a call cut by max_tokens keeps its partial
    arguments, as OpenAI returns them, and a cut call-layout fragment is dropped: `ToolCallStream`);
    any other completion is content (None if empty)."""
    st = ToolCallStream()
    content, entries = st.feed(text, final=True)
    calls: dict[int, dict] = {}
    for e in entries:
        c = calls.setdefault(e["index"], {"id": e.get("id"), "type": "function",
                                          "function": {"name": e["function"].get("name"), "arguments": ""}})
        c["function"]["arguments"] += e["function"].get("arguments", "")
    return (content or None), [calls[i] for i in sorted(calls)]


@dataclass
class ToolCallStream:
    """Turns a completion's text, piece by piece, into OpenAI `delta`s as vLLM streams calls: per call,
    one entry with its index, id, type and name (`arguments: ""`), then the arguments' text in pieces
    as it is generated. The first characters decide: a completion that starts with `<tool_call>\n`
    is calls (separated by one newline); any other is content throughout (`tool_choice: auto`'s text
    branch — a call block written inside text is text, never a call). A completion cut by max_tokens
    (finish_reason "length") inside a call's arguments keeps that call with its partial arguments,
    as OpenAI and vLLM's streaming return them; cut anywhere else in the call layout (inside
    `<tool_call>`, before the call's name, inside its closing), the fragment is neither a call nor
    content: it is dropped, so `content` stays null beside calls. `feed(text, final)` returns
    (content piece, tool-call delta entries); `calls` counts calls opened."""

    buf: str = ""
    pos: int = 0  # characters of buf handled
    calls: int = 0
    state: str = "start"  # start | open (after a separator) | head | args | tail | plain
    depth: int = 0
    in_str: bool = False
    esc: bool = False
    head_at: int = 0  # where the current call's "<tool_call>" began

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict]]:
        """The content piece and tool-call delta entries of `text` (the next piece of the completion);
        `final`: the completion ends here (text held back — a possible `<tool_call>` opening, an
        unfinished call header — is released as content)."""
        self.buf += text
        content, out = "", []
        while self.pos < len(self.buf):
            rest = self.buf[self.pos:]
            if self.state == "plain":
                content += rest
                self.pos = len(self.buf)
            elif self.state in ("start", "open"):
                if rest.startswith(OPEN):
                    self.head_at, self.pos, self.state = self.pos, self.pos + len(OPEN), "head"
                elif OPEN.startswith(rest) and not final:
                    break  # may still become "<tool_call>\n"
                elif OPEN.startswith(rest):  # the completion ends inside a call's opening: dropped
                    self.pos = len(self.buf)
                else:
                    self.state = "plain"
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
            else:  # tail: the call's "}" + CLOSE, then "\n" before the next call
                need = "}" + CLOSE
                if len(rest) <= len(need) and need.startswith(rest) and not final:
                    break  # wait for the close, and for the character after it ("\n": another call)
                if final and need.startswith(rest):  # cut inside the close: the arguments are whole
                    self.pos, self.calls = len(self.buf), self.calls + 1
                    continue
                if not rest.startswith(need):
                    self.state = "plain"  # not this layout: the rest is content
                    continue
                self.pos += len(need)
                self.calls += 1
                if self.buf[self.pos:self.pos + 1] == "\n":
                    self.pos += 1
                self.state = "open"
        if final and self.state == "head":  # a call cut inside its header, before its name: dropped
            self.pos = len(self.buf)
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
