"""The one place engines are built (`make_engine`), and the one way a draft enters a live engine
(`install_draft`, with the suffix corpus deployed beside it)."""
from __future__ import annotations

import logging
from pathlib import Path

from ..assets import cache_dir
from ..config import EngineParams, tree_num_draft_tokens
from ..models.load import runner_for
from ..models.runner import DraftRunner
from ..models.target import Target
from ..workspace import class_dirs, served
from .calibration import load_or_calibrate
from .generation import CaptureSink
from .policy import GoodputPolicy, PolicyConfig
from .proposers import default_proposers
from .speculative import Engine
from .suffix_tree import CORPUS_FILE, SuffixCache, load_corpus

log = logging.getLogger(__name__)


def make_engine(cfg: EngineParams, target: Target, runner: DraftRunner | None = None, *, version: str | None = None,
                capture: CaptureSink | None = None, progress=None,
                replayed: dict[str, tuple[float, float]] | None = None, forced_tokens: bool = True) -> Engine:
    """An engine as `cfg` (`EngineParams`, whole) says: the goodput policy when `cfg.adaptive` and it has
    a proposer to choose (a draft, or the suffix proposer), calibrated once per machine, target,
    draft shape, thread count and max_batch (cached under the download cache; `progress(message)`
    is told what a first calibration does, ≤ ~1 min on 2 cores); the suffix proposer's cache when
    `cfg.suffix.enabled`. A plain engine (evaluation, demos, fixed-k benchmarks) passes
    `cfg.fixed()`. `capture`: the sink asked at admission and handed each captured record;
    `version`, `replayed`: the draft's version and replayed first-token acceptance (version.json's,
    `workspace.served`), as a hot-swap gives them; `forced_tokens`: see `Engine`. The engine and its
    policy run tidespec's proposers (`default_proposers`, one registry value for both)."""
    proposers, pol = default_proposers(), None
    if cfg.adaptive and (runner is not None or cfg.suffix.enabled):
        rows = max(cfg.suffix.max_spec + 1 if cfg.suffix.enabled else 0,
                   tree_num_draft_tokens(cfg.num_draft_tokens, cfg.tree.eagle_topk, cfg.tree.num_draft_tokens)
                   if cfg.tree.eagle_topk > 1 and runner is not None else 0)
        cal = load_or_calibrate(target, runner, cfg.num_draft_tokens, cache_dir(), max_batch=cfg.max_batch,
                                max_rows=rows, progress=progress)
        pol = GoodputPolicy(cal, PolicyConfig.from_params(cfg), proposers=proposers)
    sx = cfg.suffix
    suffix = SuffixCache(sx.max_depth, sx.max_tokens, sx.max_spec, sx.alpha, sx.min_score) if sx.enabled else None
    return Engine(target, runner, cfg, policy=pol, suffix=suffix, capture=capture, draft_version=version,
                  replayed=replayed if runner is not None else None, forced_tokens=forced_tokens, registry=proposers)


def load_suffix_corpus(engine: Engine, draft_dir: Path | None) -> int | None:
    """Install the suffix corpus deployed with a draft (`<draft_dir>/suffix_corpus.safetensors`,
    written by the cycle's train step) as the engine's global suffix tree. Returns the tokens
    retained, or None when the engine has no suffix proposer or the draft has no corpus (the live
    tree is kept). Raises ValueError for a malformed corpus file (the live tree is kept)."""
    if engine.suffix is None or draft_dir is None or not (Path(draft_dir) / CORPUS_FILE).exists():
        return None
    return engine.set_suffix_corpus(load_corpus(Path(draft_dir) / CORPUS_FILE))


def install_suffix_corpus(engine: Engine, draft_dir: Path | None) -> int | None:
    """`load_suffix_corpus` that never raises: a malformed corpus is logged and the live suffix
    tree keeps serving (a draft is never refused for its corpus). Returns the tokens retained or None."""
    try:
        return load_suffix_corpus(engine, draft_dir)
    except ValueError as e:
        log.error("suffix corpus of %s not loaded (the live suffix tree keeps serving): %s", draft_dir, e)
        return None


def install_draft(engine: Engine, draft_dir: Path, version: str | None = None, workload: str = "") -> dict:
    """Swap `engine`'s draft for the checkpoint in `draft_dir` and install the suffix corpus deployed
    with it: the one way a draft enters a live engine (server `/admin/draft`, its champion watchers,
    `deploy.local.reload_if_changed`). `workload`: the draft of that class only (`Engine.set_draft`;
    its corpus is not installed: the global suffix tree is the generalist's, which every class's
    traffic feeds). The engine swaps between steps; requests in flight finish on the draft they
    started with. `version`: used when `draft_dir` has no version.json. Returns {"draft_version",
    "suffix_corpus_tokens" (None: no corpus, a class draft, or no suffix proposer)}. Raises
    ValueError (no checkpoint there, another target's draft, wrong shapes, over
    `engine.draft_memory_mb`) or OSError (unreadable files): the old draft keeps serving."""
    runner = runner_for(draft_dir, engine.target)
    if runner is None:
        raise ValueError(f"no draft checkpoint at {draft_dir} (config.json + model.safetensors)")
    meta = served(Path(draft_dir))
    version = meta["version"] or version
    engine.set_draft(runner, version, replayed=meta["replayed"], workload=workload)
    corpus = install_suffix_corpus(engine, draft_dir) if not workload else None
    return {"draft_version": version, "suffix_corpus_tokens": corpus}


def install_class_drafts(engine: Engine, root: Path) -> dict[str, str | None]:
    """The workload classes' own champions deployed under `root` (data/drafts/classes/<class>,
    `workspace.class_dirs`) into `engine`, each for its class (`install_draft`): what `tidespec serve`
    does at start and the benchmarks do to serve as it does. A draft the engine refuses is logged and
    its class keeps the generalist. Returns {class: version installed, None for one refused}."""
    out: dict[str, str | None] = {}
    for workload, d in class_dirs(root).items():
        try:
            out[workload] = install_draft(engine, d, workload=workload)["draft_version"]
        except (ValueError, OSError) as e:
            log.error("class %r's champion at %s not loaded, the generalist serves it: %s", workload, d, e)
            out[workload] = None
    return out
