"""The workload class of an OpenAI request when the client does not name one: what the goodput
policy keys its acceptance estimates on, what capture tags records with, and what /metrics and the
cycle report per class.

Order (first that applies): the request's `workload` field (tidespec's extension, an override);
the served model alias, when `serve.workload_by_model` maps it; `structured` for a request
constrained by `response_format` (json_object / json_schema) or `tools`; else the content of the
user messages, joined (the first 4000 characters: a conversation keeps the class its first turns
set): `code` (code fences, code lines, programming vocabulary), `math` (a word problem: numbers and
arithmetic or a quantity question), or `chat`. The content rules are linear-time regular
expressions over surface features (no model, ~0.2 ms per request); their separation of the shipped
sets is measured by `tidespec bench classes` (bench/results/classes.md).
"""
from __future__ import annotations

import re
from collections.abc import Callable

STRUCTURED = "structured"
CODE, MATH, CHAT = "code", "math", "chat"
DEFAULT = "default"  # a request's class when none is named or derived
CLASSES = (CODE, MATH, CHAT, STRUCTURED, DEFAULT)  # the classes the server itself assigns

_FENCE = re.compile(r"```")
# line starts: `[ \t]*`, never `\s*` (it would run over every blank line below each line start: quadratic)
_SIGNATURE = re.compile(
    r"^[ \t]*(def \w+\(.*\)\s*(->.*)?:|(async )?function \w*\(|(public|private|static) [\w<>\[\]]+ \w+\(|"
    r"fn \w+\(|func \w+\(|#include <|>>> )",
    re.MULTILINE,
)
_CODE_LINE = re.compile(
    r"^[ \t]*(def |class |import |from \w[\w.]* import |#include|function\b|public |private |const |let |var |"
    r"return\b|for \(|for \w+ in |while \(|if \(|SELECT |CREATE TABLE|\}|\w+\s*=\s*[\w\[\{\(\"']+.*[;)]?$)",
    re.MULTILINE)
_CODE_WORDS = re.compile(
    r"\b(python|java|javascript|typescript|c\+\+|rust|golang|sql|regex|html|css|bash|function|functions|code|"
    r"program|script|algorithm|implement|compile|debug|api|class|method|array|string|integer|recursion|"
    r"docstring|unit test)\b", re.IGNORECASE)
_NUMBER = re.compile(r"(?<![A-Za-z_.\d])\d+(?:[.,]\d+)?")
_MATH_WORDS = re.compile(
    r"(\bhow (many|much|long|far|old)\b|\bcalculate\b|\bsolve\b|\bequation\b|\bprobability\b|\bpercent\b|%|"
    r"\btotal\b|\bsum of\b|\baverage\b|\bremainder\b|\barea\b|\bperimeter\b|[+\-*/^=×÷]\s*\d|\$\s?\d)",
    re.IGNORECASE)


def content_class(text: str) -> str:
    """`code`, `math` or `chat` from the text of a prompt (see the module docstring). Pure, O(len)."""
    t = text[:4000]
    code = 3 * len(_FENCE.findall(t)) + 2 * len(_SIGNATURE.findall(t)) + len(_CODE_LINE.findall(t)) + \
        len(_CODE_WORDS.findall(t))
    if code >= 2:
        return CODE
    numbers = len(_NUMBER.findall(t))
    if (numbers >= 1 and _MATH_WORDS.search(t)) or (numbers >= 2 and t.rstrip().endswith(("?", "？", "か。"))):
        return MATH
    return CHAT


def workload_of(explicit: str | None, model: str | None, by_model: dict[str, str], constrained: bool,
                text: Callable[[], str], derive: bool = True) -> str:
    """The request's class: `explicit` (the `workload` field) if set, else the class `by_model` maps
    the requested model alias to, else — when `derive` — `structured` when `constrained`, else
    `content_class(text())` (`text` is called only then); else "default"."""
    if explicit:
        return explicit
    if model is not None and model in by_model:
        return by_model[model]
    if not derive:
        return DEFAULT
    if constrained:
        return STRUCTURED
    return content_class(text())
