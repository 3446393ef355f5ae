"""Train a candidate draft here, in this process: the embedded trainer or the SpecForge CLI.

`cycle.train_candidate` (the one train entry of the flow, `tidespec stage train` / `dvc repro`
and the `tide-train` deployment) decides *where* training runs (here, torchrun's ranks, a Prefect
work pool, a SageMaker training job) and asks `check` first, once, whatever the route; whichever it
picks ends in `train_here`, inside the ranks, the pool's run or the SageMaker container too.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..capture.curate import load_records
from ..capture.ingest import Rehydrator
from ..config import Params, TrainParams
from ..models.hf_files import target_id
from ..models.target import Target
from .online import online
from .source import IndexRecords, ShardLocator
from .specforge import SpecForgeUnavailable, train_specforge, unavailable_reason
from .trainer import train_draft


def preflight(train: TrainParams) -> None:
    """Fail before serving or loading anything when the configured trainer (`train`, params.train)
    cannot run here (train.backend: specforge without CUDA or without its CLI). Raises
    SpecForgeUnavailable."""
    if train.backend == "specforge":
        reason = unavailable_reason(train.specforge_bin)
        if reason:
            raise SpecForgeUnavailable(reason)


def skip_reason(train: TrainParams, curated: Path, target_id: str | None = None) -> str | None:
    """Why a cycle should not train on this curated set (None: go ahead): too few new tokens
    (the window's records; replayed ones do not count) for `train` (params.train). Raises
    FileNotFoundError when the curated index is missing (the fix: run curate first), ValueError
    when it is another target's set than `target_id` (None: not checked)."""
    if not Path(curated).exists():
        raise FileNotFoundError(f"curated index {curated} missing: run `tidespec stage curate` (or the flow) first")
    idx = json.loads(Path(curated).read_text())
    if target_id is not None and idx["target_id"] != target_id:
        raise ValueError(f"curated set is for target {idx['target_id'][:12]}, the configured target is "
                         f"{target_id[:12]}; curate snapshots of this target")
    fresh = [e for e in idx["train"] if not e.get("replay")]  # replayed old records are not new traffic
    n = sum(e["num_tokens"] for e in fresh)
    if n < train.min_train_tokens:
        return (
            f"curated training set has {n} new tokens in {len(fresh)} records, below "
            f"train.min_train_tokens={train.min_train_tokens}; capture more traffic (dropped: {idx['dropped']})"
        )
    return None


def check(params: Params, curated: Path, route: str) -> str | None:
    """The checks before a train route starts (`route`, as `steps.cycle.train_route` names it), in
    one place and before any weights are loaded: a trainer that runs on this machine (`torchrun`'s
    ranks, `here`) must be able to (`preflight`); then `skip_reason`, holding the set to the
    target's id hashed from its files (`models.hf_files.target_id`: nothing leaves, and nothing is
    loaded, for another target's set or one too small to train), except for `torchrun` (each rank
    checks it against the target it loads). Returns the reason to skip, or None. Raises
    SpecForgeUnavailable, FileNotFoundError / ValueError as `skip_reason` and
    `models.hf_files.target_dir`."""
    if route in ("torchrun", "here"):
        preflight(params.train)
    return skip_reason(params.train, curated, None if route == "torchrun" else target_id(params))


def train_here(params: Params, target: Target, curated: Path, init: Path | None, out: Path, progress=None,
               rehydrator: Rehydrator | None = None, shards: ShardLocator | None = None) -> dict:
    """Train a candidate from the curated index into `out` with `target` (params.target's, loaded:
    `models.load.get_target`), warm-started from `init` when given and `train.warm_start`.
    Tokens-only records (`ingest.mode: online`) get their hidden states from `rehydrator` as they
    are read (`train.online`; None: the target in this process); shards the workspace lacks come
    from `shards` (the DVC remote through a bounded cache). Returns the trainer's metrics, or
    {"skipped": reason} when the set is too small (`skip_reason`; nothing is written, the champion
    keeps serving). A killed run resumes from its last training-state checkpoint. Raises ValueError
    for another target's set, for tokens-only records with the SpecForge backend or with
    `ingest.rehydrate_backend: vllm` and no rehydrator, FileNotFoundError for a missing index,
    SpecForgeUnavailable for the SpecForge backend off-GPU."""
    if reason := skip_reason(params.train, curated, target.target_id):
        return {"skipped": reason}
    idx = json.loads(Path(curated).read_text())
    base = Path(curated).parent
    online_set = any(e.get("tokens_only") for e in idx["train"] + idx["val"])
    if online_set and params.train.backend == "specforge":
        raise ValueError("the curated set holds tokens-only records (ingest.mode: online) and train.backend "
                         "specforge reads hidden states from disk: use train.backend embedded, or ingest.mode hidden")
    if online_set and rehydrator is None and params.ingest.rehydrate_backend != "embedded":
        raise ValueError("ingest.rehydrate_backend vllm: the train step's producer is a vLLM extraction server "
                         "(`steps.train_data.train_rehydrator` starts or reaches it); set rehydrate_backend embedded "
                         "to rehydrate with the target here")
    if params.train.backend == "specforge":
        train, val = load_records(idx["train"], base), load_records(idx["val"], base)
        return train_specforge(train, val, target, params.draft, params.train, out, params.train.specforge_bin)
    init = init if (init is not None and params.train.warm_start and Path(init).exists()) else None
    name = params.ingest.rehydrate_url or params.ingest.rehydrate_backend
    train, val = (online(IndexRecords(idx[k], base, shards), rehydrator, target, name) for k in ("train", "val"))
    return train_draft(train, val, target, params.draft, params.train, out, init=init, progress=progress)

