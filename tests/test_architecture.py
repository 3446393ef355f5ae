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
    ("base", (PACKAGE, "errors", "hashing", "workspace", "assets", "config", "config.*")),
    ("models", ("models", "models.*", "assets.prompts")),
    ("engine", ("engine", "engine.*", "capture", "capture.store", "capture.metrics", "capture.text")),
    ("data+train", ("capture.writer", "capture.snapshots", "capture.exchange", "capture.rehydrate", "capture.ingest",
                    "capture.curate", "capture.replay_buffer", "capture.recent",
                    "train", "train.*")),
    ("serve", ("serve", "serve.*")),
    # one folder per external system (adapters/) and per serving engine (backends/: launch, supervisor,
    # swap, counters); backends.*.plugin.* run inside the engine's server and import only the engine
    ("adapters", ("adapters", "adapters.*", "backends", "backends.*")),
    ("steps", ("steps", "steps.*")),
    ("entry points", ("demos", "demos.*", "bench", "bench.*", "cli", "cli.*")),
]

# Folders show the layers: each package folder sits in one layer; a folder whose modules span two
# names the modules of its other layer (and which). The package root holds only the bottom layer's
# few shared modules (errors, hashing, workspace); the flows are not in the package (the project's flows/).
FOLDERS: dict[str, tuple[str, dict[str, str]]] = {
    "config": ("base", {}),
    "assets": ("base", {"assets.prompts": "models"}),  # the prompt sets: read from their wheels
    "models": ("models", {}),
    "engine": ("engine", {}),
    "capture": ("data+train", {"capture": "engine", "capture.store": "engine", "capture.metrics": "engine",
                               "capture.text": "engine"}),  # the capture record format sits with the engine
    "train": ("data+train", {}),
    "serve": ("serve", {}),
    "adapters": ("adapters", {}),
    "backends": ("adapters", {}),
    "steps": ("steps", {}),
    "demos": ("entry points", {}),
    "bench": ("entry points", {}),
    "cli": ("entry points", {}),
}
ROOT_MODULES_MAX = 8  # the package root is no drawer: its own modules are the shared bottom few


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
    layers = [(n, mods + ("capture.tuning",) if n == "steps" else mods) for n, mods in LAYERS]
    root = tmp_path / "tidespec"
    shutil.copytree(PKG, root, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.move(root / "steps" / "tuning.py", root / "capture" / "tuning.py")  # a steps module in capture/
    assert any(v.startswith("capture.tuning: in layer steps, but folder capture/ says data+train")
               for v in folder_violations(root, layers))
    (root / "newpkg").mkdir()
    (root / "newpkg" / "__init__.py").write_text("")
    assert "folder newpkg/: in no FOLDERS entry (add it, and to docs/architecture.md)" in folder_violations(
        root, layers
    )


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
    from tidespec.adapters.orchestrate import FLOW_NAMES
    assert FLOW_NAMES == ("tide_cycle", "tide_train", "tide_capture", "tide_rollout")
    for name in FLOW_NAMES:
        ep = entrypoint(name, repo)
        assert ep == f"flows/{name.removeprefix('tide_')}.py:{name}"
        f = load_flow(name, repo)
        assert isinstance(f, Flow) and f.name == name


@pytest.mark.parametrize("where,line", [
    ("config/params.py", "from ..cli import app\n"),  # module level
    ("engine/speculative.py", "def _f():\n    from ..steps.cycle import step_curate\n"),  # hidden in a function
    ("adapters/registry/client.py", "import tidespec.demos.demo\n"),  # absolute form
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
    (root / "hashing.py").write_text((root / "hashing.py").read_text() + "\nfrom .config.strict import Strict\n")
    (root / "config" / "strict.py").write_text((root / "config" / "strict.py").read_text()
                                               + "\nfrom ..hashing import unit_hash\n")
    assert ["config.strict", "hashing"] in cycles(root)


def test_the_package_root_is_no_drawer():
    """The root holds the shared bottom modules only; everything else lives in a folder named for its role."""
    root = sorted(p.name for p in PKG.glob("*.py"))
    assert len(root) <= ROOT_MODULES_MAX, root
    assert all(_layer(m.removesuffix(".py") if m != "__init__.py" else PACKAGE) == 0 for m in root), root


CLASS_LINES_MAX, MODULE_LINES_MAX = 300, 450  # a class and a module a reader can hold in their head


def test_no_class_or_module_outgrows_a_reader():
    """A class over CLASS_LINES_MAX lines or a module over MODULE_LINES_MAX is split by role (as
    engine/proposers and engine/policy were split out of the engine), never waved through."""
    big = []
    for path in PKG.rglob("*.py"):
        tree, n = _parse(path), path.read_text().count("\n")
        big += [f"{path.relative_to(PKG)} {n} lines"] if n > MODULE_LINES_MAX else []
        big += [f"{path.relative_to(PKG)}:{c.name} {c.end_lineno - c.lineno + 1} lines" for c in ast.walk(tree)
                if isinstance(c, ast.ClassDef) and c.end_lineno - c.lineno + 1 > CLASS_LINES_MAX]
    assert big == [], big


# Outside engine/: the modules that read an engine's counters (what a proposer is to them comes from
# its attributes: `Proposer.uses_draft`, `Generation.draft_stats`, the kind as a label)
PROPOSER_FREE = ("serve/metrics.py", "capture/writer.py")
PROPOSER_SHARED = {"engine.proposers", "engine.proposers.base", "engine.proposers.registry"}


def _proposer_free_files():
    yield from (p for p in (PKG / "engine").rglob("*.py") if "proposers" not in p.parts)
    yield from (PKG / f for f in PROPOSER_FREE)


def test_no_proposer_is_named_in_the_engine_outside_its_own_module():
    """Proposers are plugins: engine/ code outside proposers/ (and the serve metrics and capture writer,
    `PROPOSER_FREE`) never names one — no string equal to a proposer's kind, no import of a
    proposer's own module (only `proposers`, `proposers.base`, `proposers.registry`) — so a new
    proposer is its own module and one spec. Field names in `InvalidRequest(...)` name request fields
    (`Request.grammar`), not proposers."""
    from tidespec.engine.proposers import default_proposers
    kinds = set(default_proposers().kinds)
    mods = _modules(PKG)
    found = []
    for path in _proposer_free_files():
        tree = _parse(path)
        fields = {id(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call) and n.args
                  and getattr(n.func, "id", None) == "InvalidRequest"}
        docs = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body and isinstance(n.body[0], ast.Expr)
        }
        found += [f"{path.relative_to(PKG)}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
                  if isinstance(n, ast.Constant) and n.value in kinds and id(n) not in fields | docs]
        mod = ".".join(path.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
        found += [f"{path.relative_to(PKG)} imports {m}" for m in sorted(_imports(mod, path, mods))
                  if m.startswith("engine.proposers") and m not in PROPOSER_SHARED]
    assert kinds >= {"eagle3", "suffix", "grammar"} and found == [], found


def test_a_proposer_named_in_the_serve_metrics_is_caught(tmp_path, monkeypatch):
    root = tmp_path / "tidespec"
    shutil.copytree(PKG, root, ignore=shutil.ignore_patterns("__pycache__"))
    with (root / "serve" / "metrics.py").open("a") as f:
        f.write('\nfrom ..engine.proposers.eagle3 import Eagle3Chain\nDRAFT = "eagle3"\n')
    monkeypatch.setattr(sys.modules[__name__], "PKG", root)
    with pytest.raises(AssertionError, match=r"serve/metrics.py:\d+ 'eagle3'.*imports engine.proposers.eagle3"):
        test_no_proposer_is_named_in_the_engine_outside_its_own_module()


def test_a_new_module_must_be_placed(tmp_path):
    root = tmp_path / "tidespec"
    shutil.copytree(PKG, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "newthing.py").write_text("X = 1\n")
    assert "newthing: in no layer (add it to LAYERS and docs/architecture.md)" in violations(root)
