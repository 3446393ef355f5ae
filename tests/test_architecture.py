"""Layers point one way: every `tidespec` import (function-level ones included) goes to a module in
the same layer or a lower one, and no import cycle exists (after SpecForge's
tests/test_architecture/test_package_dependencies.py). docs/architecture.md explains the order."""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "tidespec"
PACKAGE = "(tidespec/__init__)"

# low → high; a module may import its own layer and the layers below it, never above
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", (PACKAGE, "errors", "strict", "hashing", "config", "sagemaker_config", "workspace", "assets", "plots")),
    ("models", ("models", "models.target", "models.eagle3", "prompts", "bootstrap")),
    ("engine", ("engine", "engine.stats", "engine.sampling", "engine.logits", "engine.suffix", "detok", "engine.calibration", "engine.goodput", "engine.adaptive", "engine.tree", "engine.speculative", "capture.text",
                "engine.replay", "capture", "capture.store", "capture.metrics")),
    ("data+train", ("capture.writer", "capture.exchange", "capture.rehydrate", "capture.ingest", "curate", "tuning",
                    "train", "train.resume", "train.trainer", "train.specforge",
                    "train.entry", "train.sagemaker", "runtime")),
    ("serve", ("serve", "serve.protocol", "serve.errors", "serve.metrics", "serve.textlog", "serve.lifespan", "serve.engine_loop", "serve.responses", "serve.serving", "serve.streaming", "serve.openai", "serve.admin", "server", "frontdoor")),
    ("adapters", ("adapters", "adapters.registry", "adapters.versioning", "adapters.orchestrate", "adapters.process",
                  "adapters.services", "adapters.aws", "adapters.sagemaker_train", "adapters.sagemaker_deploy",
                  "adapters.s3_capture", "adapters.publish", "adapters.sglang")),
    ("steps", ("cycle", "deploy", "deploy.local")),
    ("entry points", ("demo", "demo_sagemaker", "bench", "bench.*", "cli")),
]


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for f in root.rglob("*.py"):
        rel = f.relative_to(root).with_suffix("")
        out[".".join(rel.parts).removesuffix(".__init__").removesuffix("__init__")] = f
    out[PACKAGE] = out.pop("")  # the package's own __init__: in the base layer (it must import nothing)
    return out


def _layer(mod: str) -> int:
    for i, (_, mods) in enumerate(LAYERS):
        for m in mods:
            if mod == m or (m.endswith(".*") and mod.startswith(m[:-1])):
                return i
    raise KeyError(mod)


def _imports(mod: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Package-internal modules `mod` imports anywhere in its body (relative and absolute forms)."""
    out = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["tidespec"] + (mod.split(".") if mod != PACKAGE else [])
                base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            names = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            if not n.startswith("tidespec"):
                continue
            n = n.removeprefix("tidespec").removeprefix(".")
            while n and n not in mods:
                n = n.rpartition(".")[0]
            n = n or PACKAGE
            if n != mod and not (mod == PACKAGE and n == PACKAGE):
                out.add(n)
    return out


def graph(root: Path = PKG) -> dict[str, set[str]]:
    mods = _modules(root)
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def violations(root: Path = PKG) -> list[str]:
    """Imports against the layer order, and modules no layer names."""
    out = []
    for mod, deps in sorted(graph(root).items()):
        try:
            lm = _layer(mod)
        except KeyError:
            out.append(f"{mod}: in no layer (add it to LAYERS and docs/architecture.md)")
            continue
        for d in sorted(deps):
            if not (mod.startswith(d + ".") and Path(root, *d.split("."), "__init__.py").exists()) and _layer(d) > lm:
                out.append(f"{mod} ({LAYERS[lm][0]}) imports {d} ({LAYERS[_layer(d)][0]}): upward")
    return out


def cycles(root: Path = PKG) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    g = graph(root)
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_imports_point_down_and_no_cycles():
    assert violations() == []
    assert cycles() == []


@pytest.mark.parametrize("where,line", [
    ("config.py", "from .cli import app\n"),  # module level
    ("engine/speculative.py", "def _f():\n    from ..cycle import step_curate\n"),  # hidden in a function
    ("adapters/registry.py", "import tidespec.demo\n"),  # absolute form
    ("__init__.py", "from .cli import app\n"),  # the package's own __init__
])
def test_an_injected_upward_import_is_caught(tmp_path, where, line):
    root = tmp_path / "tidespec"
    shutil.copytree(PKG, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / where).write_text((root / where).read_text() + "\n" + line)
    assert any("upward" in v for v in violations(root))


def test_an_injected_cycle_is_caught(tmp_path):
    root = tmp_path / "tidespec"
    shutil.copytree(PKG, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "hashing.py").write_text((root / "hashing.py").read_text() + "\nfrom .strict import Strict\n")
    (root / "strict.py").write_text((root / "strict.py").read_text() + "\nfrom .hashing import unit_hash\n")
    assert ["hashing", "strict"] in cycles(root)


def test_a_new_module_must_be_placed(tmp_path):
    root = tmp_path / "tidespec"
    shutil.copytree(PKG, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "newthing.py").write_text("X = 1\n")
    assert "newthing: in no layer (add it to LAYERS and docs/architecture.md)" in violations(root)


def test_flows_live_in_the_project_not_the_package():
    """prefect.yaml's entrypoints are files under the project's flows/ (as Prefect projects lay them
    out), each defines the flow it names, and no module of the package imports them."""
    from prefect import Flow

    from tidespec.adapters.orchestrate import entrypoint, load_flow
    assert not (PKG / "flows").exists()
    for mod, path in _modules(PKG).items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not [n for n in names if n == "flows" or n.startswith("flows.")], f"{mod} imports {names}"
    repo = PKG.parents[1]
    for name in ("tide_cycle", "tide_train", "tide_capture"):
        ep = entrypoint(name, repo)
        assert ep == f"flows/{name.removeprefix('tide_')}.py:{name}"
        f = load_flow(name, repo)
        assert isinstance(f, Flow) and f.name == name
