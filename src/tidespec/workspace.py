"""Where a workspace keeps its files, the one reader/writer of a draft's `version.json`, and
`private_dir` (a directory only its owner reads: captured hidden states, the DVC cache and remote).

Bottom layer (paths, JSON and file modes only): every other module asks `Workspace` for a path instead of
joining its own. The layout (under `root`):

    data/capture/<target_id[:12]>/    live capture (writer's shards + manifest)
    data/snapshots/<target_id>/<sid>/ sealed snapshots (DVC-tracked)
    data/work/                        the cycle's scratch: curated.json, holdout.jsonl, candidate/, eval.json
    data/drafts/champion/             the served draft bundle: draft/ (what engines load) + sidecars
    .tidespec/                        services' state, DVC remote, locks
    .tidespec/registry/               a replica's copies of the registry's champions (serve.champion_source)
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

VERSION_FILE = "version.json"
DRAFT_FILES = ("config.json", "model.safetensors")  # exactly what vLLM / SGLang read from a draft dir
ENGINE_SUBDIR = "draft"


def private_dir(d: Path) -> Path:
    """mkdir -p with 0700 (hidden states can be inverted to recover prompts)."""
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(d, 0o700)
    return d


@dataclass(frozen=True)
class Workspace:
    """Where a cycle's files live (all under `root`)."""

    root: Path

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def snapshots(self) -> Path:
        return self.data / "snapshots"

    def capture_dir(self, target_id: str) -> Path:
        return self.data / "capture" / target_id[:12]

    def text_capture_dir(self, target_id: str) -> Path:
        """Text capture of `tidespec serve` (`capture.mode: text`): Data Capture JSON Lines."""
        return self.data / "capture" / f"{target_id[:12]}-text"

    def ingest_dir(self, target_id: str) -> Path:
        """Capture dir of ingested production traffic (its own writer: a live server keeps its own)."""
        return self.data / "capture" / f"{target_id[:12]}-ingest"

    @property
    def work(self) -> Path:
        return self.data / "work"

    @property
    def curated(self) -> Path:
        return self.work / "curated.json"

    @property
    def candidate(self) -> Path:
        return self.work / "candidate"

    @property
    def eval_report(self) -> Path:
        return self.work / "eval.json"

    @property
    def register_report(self) -> Path:
        """The register step's decision (`tidespec stage register`, dvc.yaml)."""
        return self.work / "register.json"

    @property
    def drafts(self) -> Path:
        """Drafts a server may load (`/admin/draft` paths must lie inside)."""
        return self.data / "drafts"

    @property
    def champion(self) -> Path:
        """The generalist's champion bundle: serves every class without a champion of its own."""
        return self.drafts / "champion"

    @property
    def class_champions(self) -> Path:
        """One champion bundle per workload class that has its own (`<class>/`, registry alias
        `champion-<class>`)."""
        return self.drafts / "classes"

    def served_champions(self, source: str = "directory") -> tuple[Path, Path]:
        """(the generalist's champion bundle, the root of the class champions) a server serves from,
        by `serve.champion_source`: `directory` — `champion` and `class_champions`, which the cycle's
        deploy step writes; `registry` — a replica's own copies of the registry's champions,
        `.tidespec/registry/champion` and `.tidespec/registry/classes` (the registry follower writes
        them). Raises ValueError for another source."""
        if source == "directory":
            return self.champion, self.class_champions
        if source == "registry":
            return self.state / "registry" / "champion", self.state / "registry" / "classes"
        raise ValueError(f"champion source {source!r}: expected directory or registry")

    @property
    def eval_prompts(self) -> Path:
        """Holdout requests' prompts, written by curate (replayed by evaluate)."""
        return self.work / "holdout.jsonl"

    @property
    def state(self) -> Path:
        return self.root / ".tidespec"

    @property
    def last_cycle(self) -> Path:
        """Snapshots the last completed cycle curated (`cycle.mark_done`)."""
        return self.work / "last_cycle.json"


def read_version(draft_dir: Path) -> dict | None:
    """`{"version": str, "run_id": str, "tuned_k": {profile: k}, "replayed": {class: a₁}, "tau_k":
    [τ]}` of a draft dir that came from the registry (tuned_k: the per-endpoint window the register
    step chose; replayed: the first-token acceptance its evaluation replayed, overall under "" and
    per workload class — `engine.health`; {} when none; tau_k: the acceptance length it replayed at
    k = 0, 1, ... — the SageMaker acceptance alarm's reference; [] when none), None when the dir
    has no version.json. Raises ValueError for a version.json that is not such an object."""
    f = Path(draft_dir) / VERSION_FILE
    if not f.exists():
        return None
    meta = json.loads(f.read_text())
    if not isinstance(meta, dict) or "version" not in meta:
        raise ValueError(f"{f}: expected an object with 'version'")
    tuned = meta.get("tuned_k", {})
    if not isinstance(tuned, dict) or not all(isinstance(k, int) and k >= 0 for k in tuned.values()):
        raise ValueError(f"{f}: tuned_k must map profile names to non-negative integers")
    rep = meta.get("replayed", {})
    if not isinstance(rep, dict) or not all(
            isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                        for x in v) and 0 <= v[0] <= 1 and 0 <= v[1] < math.inf
            for v in rep.values()):
        raise ValueError(f"{f}: replayed must map workload classes to [acceptance in [0, 1], finite chains >= 0]")
    tau_k = meta.get("tau_k", [])
    if not valid_tau_k(tau_k):
        raise ValueError(f"{f}: tau_k must list the acceptance length at k = 0, 1, ...: 1 at k = 0, never "
                         "falling, at most k + 1")
    return {"version": str(meta["version"]), "run_id": str(meta.get("run_id", "")), "tuned_k": tuned,
            "replayed": {str(k): [float(a), float(n)] for k, (a, n) in rep.items()},
            "tau_k": [float(t) for t in tau_k]}


def valid_tau_k(tau_k) -> bool:
    """True for a list of acceptance lengths τ(k), k = 0, 1, ... that a chain replay can give:
    numbers, τ(0) = 1, never falling with k, τ(k) ≤ k + 1 (an empty list too: none recorded)."""
    if not isinstance(tau_k, list) or not all(isinstance(t, (int, float)) and not isinstance(t, bool)
                                              for t in tau_k):
        return False
    return not tau_k or (tau_k[0] == 1 and all(a <= b for a, b in zip(tau_k, tau_k[1:]))
                         and all(t <= k + 1 for k, t in enumerate(tau_k)))


CLASS_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")  # a workload class with a champion of its own


def class_dirs(root: Path) -> dict[str, Path]:
    """{class: its champion bundle} under `root` (`Workspace.class_champions`), deployed ones only
    (a `version.json` inside, a valid class name)."""
    root = Path(root)
    if not root.exists():
        return {}
    return {d.name: d for d in sorted(root.iterdir()) if d.is_dir() and CLASS_NAME.match(d.name)
            and (d / "version.json").exists()}


def served_version(draft_dir: Path) -> str | None:
    """Registry version of the draft in `draft_dir` (None: not from the registry, or no draft)."""
    return served(draft_dir)["version"]


def served(draft_dir: Path) -> dict:
    """What an engine serving the draft in `draft_dir` is told about it, as `make_engine` /
    `Engine.set_draft` keywords: {"version": registry version or None, "replayed": its replayed
    first-token acceptance {class: [a₁, chains]} or None}."""
    meta = read_version(draft_dir) or {}
    return {"version": meta.get("version"), "replayed": meta.get("replayed") or None}


def write_version(draft_dir: Path, version: str, run_id: str, tuned_k: dict[str, int] | None = None,
                  replayed: dict[str, list[float]] | None = None, tau_k: list[float] | None = None) -> None:
    """Record which registry version (and MLflow run) `draft_dir` holds, the per-endpoint window
    its register step tuned (profile → k, 0 = speculation off), the first-token acceptance its
    evaluation replayed (class → [a₁, chains], "" overall) and the acceptance length it replayed
    at each window (τ(0..K))."""
    meta = {"version": str(version), "run_id": run_id} | ({"tuned_k": dict(tuned_k)} if tuned_k else {}) | \
        ({"replayed": dict(replayed)} if replayed else {}) | ({"tau_k": list(tau_k)} if tau_k else {})
    (Path(draft_dir) / VERSION_FILE).write_text(json.dumps(meta))


# -- draft bundles ---------------------------------------------------------------------------------
# A deployed draft is a *bundle*: `<bundle>/draft/` holds exactly DRAFT_FILES, the directory vLLM
# (`speculative_config.model`) and SGLang (`--speculative-draft-model-path`) load — both read every
# `*.safetensors` in it, so nothing else may live there. Sidecars (the suffix corpus, version.json,
# train_metrics.json) sit beside it in `<bundle>/`. A flat checkpoint (a trainer's output dir) is
# its own engine dir.


def engine_dir(draft_dir: Path) -> Path:
    """The directory an engine loads for `draft_dir`: `<draft_dir>/draft` for a bundle, else
    `draft_dir` itself (a flat checkpoint)."""
    sub = Path(draft_dir) / ENGINE_SUBDIR
    return sub if (sub / "config.json").is_file() else Path(draft_dir)


def bundle_files(draft_dir: Path) -> tuple[list[Path], list[Path]]:
    """(engine files, sidecar files) of a bundle or a flat checkpoint: engine files are DRAFT_FILES
    from `engine_dir`; sidecars are every other plain file, at the top or (legacy) inside the engine dir."""
    top, eng = Path(draft_dir), engine_dir(draft_dir)
    engine = [eng / f for f in DRAFT_FILES if (eng / f).is_file()]
    side = [f for d in {top, eng} for f in sorted(d.iterdir()) if f.is_file() and f not in engine]
    return engine, side


def copy_engine_files(draft_dir: Path, dest: Path) -> Path:
    """Copy DRAFT_FILES of `draft_dir` (bundle or flat checkpoint) into `dest` (created; files there
    are overwritten): a directory an engine loads. Returns `dest`. Raises FileNotFoundError naming a
    missing file."""
    src, dest = engine_dir(draft_dir), Path(dest)
    missing = [f for f in DRAFT_FILES if not (src / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{draft_dir} is not a draft checkpoint (no {', '.join(missing)} in {src})")
    dest.mkdir(parents=True, exist_ok=True)
    for f in DRAFT_FILES:
        shutil.copyfile(src / f, dest / f)
    return dest


def make_bundle(src: Path, dest: Path) -> Path:
    """Copy the draft in `src` (bundle or flat checkpoint) into a new bundle at `dest` (must not
    exist): DRAFT_FILES into `dest/draft/`, every other file beside it. Returns `dest`. Raises
    FileNotFoundError when `src` lacks a DRAFT_FILES file, FileExistsError when `dest` exists."""
    _, side = bundle_files(src)
    if Path(dest).exists():
        raise FileExistsError(f"{dest} exists: a bundle is written to a new directory")
    copy_engine_files(src, Path(dest) / ENGINE_SUBDIR)  # checks src first: nothing is created for a non-draft
    for f in side:
        shutil.copyfile(f, Path(dest) / f.name)
    return Path(dest)
