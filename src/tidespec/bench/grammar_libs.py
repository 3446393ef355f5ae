"""`tidespec bench grammar-libs`: which grammar library constrains tidespec's decoding on CPU —
xgrammar (vLLM's default backend; arXiv 2411.15100) against llguidance (an Earley matcher) on the
target's tokenizer, for any JSON object, an extraction schema and a three-tool call. Per library:
compile time (ms), per generated token the time to fill the next-token bitmask and to consume the
token (µs), and one speculative step (k = 4 consumed, 5 masks, 4 rolled back). Passes interleave the
libraries; each figure is the median over passes with its range.

    .venv/bin/pip install xgrammar==0.2.8   # not a tidespec dependency (it pulls triton, ~1 GB)
    tidespec bench grammar-libs --passes 5 --out bench/results/grammar-libs
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

TOOLS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}},
    {"name": "search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "limit": {"type": "integer"}}, "required": ["query"],
        "additionalProperties": False}},
    {"name": "send_email", "parameters": {"type": "object", "properties": {
        "to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
        "required": ["to", "subject", "body"], "additionalProperties": False}},
]
EXTRACTION = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "role": {"enum": ["engineer", "manager", "designer"]},
    "skills": {"type": "array", "items": {"type": "string"}}, "remote": {"type": "boolean"}},
    "required": ["name", "age", "role", "skills", "remote"], "additionalProperties": False}
TOOL_CALL = {"anyOf": [{"type": "object", "properties": {"name": {"const": t["name"]}, "arguments": t["parameters"]},
                        "required": ["name", "arguments"], "additionalProperties": False} for t in TOOLS]}
CASES = {
    "json_object": ({"type": "object"},
                    '{"title": "Quarterly report", "items": [1, 2, 3], "ok": true, "owner": {"name": "Ada"}}'),
    "extraction": (EXTRACTION, '{"name": "Grace Hopper", "age": 85, "role": "engineer", '
                               '"skills": ["COBOL", "compilers", "teaching"], "remote": false}'),
    "tool_call": (TOOL_CALL, '{"name": "send_email", "arguments": {"to": "ada@example.com", '
                             '"subject": "Minutes", "body": "Attached are the minutes of Monday."}}'),
}


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf_tok):
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(hf_tok, vocab_size=len(hf_tok))
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.mask = xgr.allocate_token_bitmask(1, self.info.vocab_size)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m):
        m.fill_next_token_bitmask(self.mask)

    def consume(self, m, t: int) -> bool:
        return m.accept_token(t)

    def rollback(self, m, n: int):
        m.rollback(n)


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf_tok):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(hf_tok)
        self.mask = llguidance.torch.allocate_token_bitmask(1, self.tok.vocab_size)
        self._fill = llguidance.torch.fill_next_token_bitmask

    def compile(self, schema: dict):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        m = self.llg.LLMatcher(self.tok, grammar)  # compiles (lexer + grammar), per schema
        assert not m.is_error(), m.get_error()
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tok, grammar)

    def fill(self, m):
        self._fill(m, self.mask, 0)

    def consume(self, m, t: int) -> bool:
        return m.consume_token(t)

    def rollback(self, m, n: int):
        m.rollback(n)


def run_case(lib, schema: dict, ids: list[int], k: int = 4) -> dict:
    t0 = time.perf_counter()
    compiled = lib.compile(schema)
    compile_ms = 1000 * (time.perf_counter() - t0)
    m = lib.matcher(compiled)
    fill, consume = [], []
    for t in ids:
        a = time.perf_counter()
        lib.fill(m)
        b = time.perf_counter()
        assert lib.consume(m, t), f"{lib.name} refused token {t}"
        fill.append(b - a)
        consume.append(time.perf_counter() - b)
    m = lib.matcher(compiled)
    step = []
    for i in range(0, len(ids) - k - 1):  # one speculative step at each position: k drafts, k+1 masks
        a = time.perf_counter()
        for j in range(k + 1):
            lib.fill(m)
            if j < k:
                assert lib.consume(m, ids[i + j])
        lib.rollback(m, k)
        step.append(time.perf_counter() - a)
        assert lib.consume(m, ids[i])
    return {"compile_ms": compile_ms, "fill_us": 1e6 * statistics.median(fill),
            "fill_p99_us": 1e6 * sorted(fill)[int(0.99 * (len(fill) - 1))],
            "consume_us": 1e6 * statistics.median(consume), "spec_step_k4_us": 1e6 * statistics.median(step),
            "tokens": len(ids)}


def parser() -> argparse.ArgumentParser:
    """The command line (`tidespec bench grammar-libs` ARGS)."""
    ap = argparse.ArgumentParser(prog="tidespec bench grammar-libs", description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=".cache/tidespec/models/smollm2-hf")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--out", required=True, help="path prefix: writes PREFIX.json and PREFIX.md")
    return ap


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(a.tokenizer)
    setup = {}
    libs = []
    for cls in (XGrammar, LLGuidance):
        t0 = time.perf_counter()
        libs.append(cls(hf_tok))
        setup[cls.name] = 1000 * (time.perf_counter() - t0)
    ids = {c: hf_tok(text, add_special_tokens=False)["input_ids"] for c, (_, text) in CASES.items()}
    runs: dict = {lib.name: {c: [] for c in CASES} for lib in libs}
    for p in range(a.passes):
        order = libs if p % 2 == 0 else libs[::-1]
        for lib in order:
            for c, (schema, _) in CASES.items():
                runs[lib.name][c].append(run_case(lib, schema, ids[c]))
    summary = {}
    for name, cases in runs.items():
        summary[name] = {"setup_ms": setup[name]}
        for c, rs in cases.items():
            summary[name][c] = {key: {"median": statistics.median(r[key] for r in rs),
                                      "min": min(r[key] for r in rs), "max": max(r[key] for r in rs)}
                                for key in rs[0] if key != "tokens"} | {"tokens": rs[0]["tokens"]}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps({"passes": a.passes, "vocab": len(hf_tok), "summary": summary,
                                               "runs": runs}, indent=1))
    lines = [f"# Grammar libraries on CPU (SmolLM2 tokenizer, V = {len(hf_tok)}; {a.passes} interleaved passes, "
             "median (min–max))", "",
             "Setup (tokenizer analysis, once per process): "
             + ", ".join(f"{n} {ms:.0f} ms" for n, ms in setup.items()), "",
             "| library | grammar | tokens | compile ms | mask fill µs/token | p99 µs | consume µs | "
             "spec step k=4 µs (5 masks, 4 consumed, rollback) |", "|---|---|---|---|---|---|---|---|"]
    for name, cases in summary.items():
        for c in CASES:
            s = cases[c]
            def f(key, s=s):
                return f"{s[key]['median']:.0f} ({s[key]['min']:.0f}–{s[key]['max']:.0f})"
            lines.append(f"| {name} | {c} | {s['tokens']} | {f('compile_ms')} | {f('fill_us')} | {f('fill_p99_us')} | "
                         f"{f('consume_us')} | {f('spec_step_k4_us')} |")
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

