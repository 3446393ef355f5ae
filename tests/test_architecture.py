"""Layers point one way: every `tidespec` import (function-level ones included) goes to a module in
the same layer or a lower one, and no import cycle exists (after SpecForge's
tests/test_architecture/test_package_dependencies.py). Folders show the layers: each package folder
sits in one layer (or names its modules of another), and no import runs back up between folders.
The Prefect flows live in the project's flows/, outside the package. docs/architecture.md explains
the order."""
from __future__ import annotations

import ast
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "src" / "tidespec"
PACKAGE = "(tidespec/__init__)"

# low → high; a module may import its own layer and the layers below it, never above
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", (PACKAGE, "errors", "strict", "hashing", "config", "sagemaker_config", "serve_launch", "workspace", "assets",
              "plots")),
    ("models", ("models", "models.target", "models.eagle3", "prompts", "bootstrap")),
    ("engine", ("engine", "engine.stats", "engine.sampling", "engine.grammar", "engine.constraint", "engine.logits", "engine.suffix", "detok", "engine.calibration", "engine.tree", "engine.health", "engine.request", "engine.invalid", "engine.generation", "engine.accept", "engine.policy", "engine.policy.cost", "engine.policy.search", "engine.policy.probes", "engine.policy.margin", "engine.policy.policy", "engine.proposers", "engine.proposers.base", "engine.proposers.registry", "engine.proposers.eagle3", "engine.proposers.eagle3_estimate", "engine.proposers.tree", "engine.proposers.suffix", "engine.proposers.grammar", "engine.plan", "engine.speculative", "capture.text",
                "engine.replay", "capture", "capture.store", "capture.metrics")),
    ("data+train", ("capture.writer", "capture.exchange", "capture.rehydrate", "capture.ingest", "curate", "tuning",
                    "train", "train.resume", "train.trainer", "train.specforge",
                    "train.entry", "train.sagemaker", "runtime", "distill")),
    ("serve", ("serve", "serve.protocol", "serve.errors", "serve.workload", "serve.metrics", "serve.textlog", "serve.lifespan", "serve.engine_loop", "serve.structured", "serve.responses", "serve.serving", "serve.streaming", "serve.openai", "serve.admin", "serve.guard", "server", "frontdoor")),
    ("adapters", ("adapters", "adapters.registry", "adapters.versioning", "adapters.orchestrate", "adapters.process",
                  "adapters.services", "adapters.aws", "adapters.sagemaker_train", "adapters.sagemaker_deploy",
                  "adapters.s3_capture", "adapters.publish", "adapters.sglang", "adapters.vllm",
                  "adapters.vllm_plugin.tidespec_hidden_states")),  # runs inside the vLLM server, imports vllm only
    ("steps", ("cycle", "deploy", "deploy.local", "deploy.vllm")),
    ("entry points", ("demo", "demo_sagemaker", "demo_vllm", "bench", "bench.*", "cli")),
]

# Folders show the layers: each package folder sits in one layer; a folder whose modules span two
# names the modules of its other layer (and which). The package root (tidespec/*.py) holds modules of
# every layer; the flows are not in the package at all (the project's flows/).
FOLDERS: dict[str, tuple[str, dict[str, str]]] = {
    "models": ("models", {}),
    "engine": ("engine", {}),
    "capture": ("data+train", {"capture": "engine", "capture.store": "engine", "capture.metrics": "engine",
                               "capture.text": "engine"}),  # the capture record format sits with the engine
    "train": ("data+train", {}),
    "serve": ("serve", {}),
    "adapters": ("adapters", {}),
    "deploy": ("steps", {}),
    "bench": ("entry points", {}),
}


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


def _parse(path: Path) -> ast.Module:
    """ast.parse, or in a fresh interpreter when this one's AST recursion counter is stale (CPython
    3.11 before 3.11.8, gh-106905: "AST constructor recursion depth mismatch" after an earlier test)."""
    try:
        return ast.parse(path.read_text())
    except SystemError:
        code = "import ast, pickle, sys; sys.stdout.buffer.write(pickle.dumps(ast.parse(open(sys.argv[1]).read())))"
        return pickle.loads(subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True,
                                           check=True).stdout)


def _imports(mod: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Package-internal modules `mod` imports anywhere in its body (relative and absolute forms)."""
    out = set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(_parse(path)):
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


def _folder(mod: str, root: Path) -> str | None:
    """The package folder `mod` lives in (None: the package root, tidespec/*.py)."""
    top = mod.split(".")[0]
    return top if mod != PACKAGE and (root / top / "__init__.py").exists() else None


def folder_violations(root: Path = PKG, layers=None, folders=None) -> list[str]:
    """Folders against the layers: a folder no FOLDERS entry places, a module in another layer than
    its folder says (or than the exception its folder names for it), and an import from one folder
    into another that sits in a higher layer (the folders' layers: a folder's modules move together)."""
    layers, folders = layers or LAYERS, folders or FOLDERS
    names = [n for n, _ in layers]

    def layer_of(mod):
        for n, mods in layers:
            if any(mod == m or (m.endswith(".*") and mod.startswith(m[:-1])) for m in mods):
                return n
        return None  # violations() reports it
    out = [f"folder {p.name}/: in no FOLDERS entry (add it, and to docs/architecture.md)"
           for p in sorted(root.iterdir()) if (p / "__init__.py").exists() and p.name not in folders]
    g = graph(root)
    for mod, deps in sorted(g.items()):
        fa = _folder(mod, root)
        if fa not in folders:
            continue
        want, got = folders[fa][1].get(mod, folders[fa][0]), layer_of(mod)
        if got is not None and got != want:
            out.append(f"{mod}: in layer {got}, but folder {fa}/ says {want} (move it, or name it in FOLDERS)")
        for d in sorted(deps):
            fb = _folder(d, root)
            if fb in folders and fb != fa and names.index(folders[fa][0]) < names.index(folders[fb][0]):
                out.append(f"{mod} (folder {fa}/, {folders[fa][0]}) imports {d} (folder {fb}/, {folders[fb][0]}): "
                           "up between folders")
    return out


def test_imports_point_down_and_no_cycles():
    assert violations() == []
    assert cycles() == []


def test_folders_show_the_layers():
    assert folder_violations() == []


def test_an_import_up_between_folders_is_caught(tmp_path):
    """engine.stats importing capture.store breaks no module layer (the record format sits with the
    engine) but runs from the engine/ folder up into capture/ (data+train): the folder check says so."""
    root = tmp_path / "tidespec"
    shutil.copytree(PKG, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "engine" / "stats.py").write_text((root / "engine" / "stats.py").read_text()
                                              + "\nfrom ..capture.store import FIELDS\n")
    assert violations(root) == []
    assert any("engine.stats" in v and "up between folders" in v for v in folder_violations(root))


def test_a_module_in_the_wrong_folder_is_caught(tmp_path):
    layers = [(n, tuple(m for m in mods if m != "tuning")) for n, mods in LAYERS]
    layers = [(n, mods + ("engine.tuning",) if n == "data+train" else mods) for n, mods in layers]
    root = tmp_path / "tidespec"
    shutil.copytree(PKG, root, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.move(root / "tuning.py", root / "engine" / "tuning.py")  # a data+train module in the engine folder
    assert any(v.startswith("engine.tuning: in layer data+train, but folder engine/ says engine")
               for v in folder_violations(root, layers))
    (root / "newpkg").mkdir()
    (root / "newpkg" / "__init__.py").write_text("")
    assert "folder newpkg/: in no FOLDERS entry (add it, and to docs/architecture.md)" in folder_violations(root, layers)


def test_flows_live_in_the_project_not_the_package():
    """prefect.yaml's entrypoints are files under the project's flows/ (as Prefect projects lay them
    out), each defines the flow it names, and no module of the package imports them."""
    from prefect import Flow

    from tidespec.adapters.orchestrate import entrypoint, load_flow
    assert not (PKG / "flows").exists()
    for mod, path in _modules(PKG).items():
        for node in ast.walk(_parse(path)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            assert not [n for n in names if n == "flows" or n.startswith("flows.")], f"{mod} imports {names}"
    repo = PKG.parents[1]
    for name in ("tide_cycle", "tide_train", "tide_capture"):
        ep = entrypoint(name, repo)
        assert ep == f"flows/{name.removeprefix('tide_')}.py:{name}"
        f = load_flow(name, repo)
        assert isinstance(f, Flow) and f.name == name


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
