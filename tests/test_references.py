"""Every backtick reference to a module, a symbol or a source path of the package — in a docstring
under src/ or in docs/ — resolves: a code move that leaves a stale name behind fails here.

A span counts as a reference when it names a package folder or root module of `tidespec` and at
least one module below it (`engine.health`, `backends.live.server_guard`, `steps/deploy/local.py`); a
span whose second name is no module (`engine.num_draft_tokens`, `serve.auto_rollback`) is a
params.yaml key, not a reference. The rest of a dotted reference must resolve as modules, then
attributes (classes, functions, constants, methods)."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "tidespec"
PARAMS_SECTIONS = {"target", "engine", "draft", "capture", "ingest", "bootstrap", "workload", "curate", "train",
                   "evaluate", "serve", "deploy"}  # a `section.key` span in these is a params.yaml key
SPAN = re.compile(r"`([A-Za-z_][\w./]*[\w/])`")
TOP = {p.stem if p.is_file() else p.name for p in PKG.iterdir() if (p.is_dir() and (p / "__init__.py").exists())
       or (p.suffix == ".py" and p.stem != "__init__")}


def _is_module(dotted: str) -> bool:
    path = PKG.joinpath(*dotted.split("."))
    return (path / "__init__.py").exists() or path.with_suffix(".py").exists()


def unresolved(span: str) -> str | None:
    """Why `span` does not resolve (None: it does, or it is not a reference)."""
    if "/" in span:
        parts = span.strip("/").split("/")
        if parts[0] not in TOP or len(parts) < 2 or not span.endswith((".py", "/")) or (ROOT / span).exists():
            return None  # not the package's, or a path from the repository's root (bench/results/)
        return None if PKG.joinpath(*parts).exists() else f"no file src/tidespec/{span}"
    names = span.split(".")
    if names[0] not in TOP or len(names) < 2 or names[-1] in ("py", "md", "yaml", "json"):
        return None
    i = 1
    while i < len(names) and _is_module(".".join(names[: i + 1])):
        i += 1
    if i == 1 and not (PKG / names[0]).is_dir():
        return None  # a root module's attribute or a params key: not checked
    if i == 1 and names[0] in PARAMS_SECTIONS and not hasattr(importlib.import_module(f"tidespec.{names[0]}"),
                                                                 names[1]):
        return None  # `engine.num_draft_tokens`: a params key
    obj = importlib.import_module("tidespec." + ".".join(names[:i]))
    for n in names[i:]:
        if not hasattr(obj, n):
            return f"tidespec.{'.'.join(names[:i])} has no {'.'.join(names[i:])}"
        obj = getattr(obj, n)
    return None


def _docstrings(path: Path):
    tree = ast.parse(path.read_text())
    for node in [tree, *ast.walk(tree)]:
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield doc


def test_docstring_and_docs_references_resolve():
    texts = [(str(p.relative_to(ROOT)), d) for p in sorted(PKG.rglob("*.py")) if "plugin" not in p.parts
             for d in _docstrings(p)]
    texts += [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "docs").rglob("*.md"))]
    bad = sorted({f"{where}: `{s}`: {why}" for where, text in texts for s in SPAN.findall(text)
                  if (why := unresolved(s))})
    assert not bad, "\n".join(bad)


def test_the_reference_check_catches_a_moved_name():
    assert unresolved("steps.deploy.live.LiveGuard") and unresolved("adapters.vllm.VLLMLaunch")
    assert unresolved("steps/deploy/vllm.py") and unresolved("backends.live.NoSuchGuard")
    assert unresolved("backends.live.server_guard") is None and unresolved("engine.health.paired_comparison") is None
    assert unresolved("engine.num_draft_tokens") is None and unresolved("serve.auto_rollback") is None
