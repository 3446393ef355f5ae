"""Where the train step's records come from, beyond the curated index: the producer of hidden
states for tokens-only records (`ingest.mode: online`, `train_rehydrator`), and the DVC remote for
shards the workspace lacks (`remote_shards`)."""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

from ..adapters.versioning import RemoteShards
from ..backends.vllm import rehydrator_for
from ..config import Params, TrainParams
from ..workspace import Workspace


def holds_tokens_only(curated: Path) -> bool:
    """True when the curated index names a tokens-only record (train or val)."""
    idx = json.loads(Path(curated).read_text())
    return any(e.get("tokens_only") for e in idx["train"] + idx["val"])


@contextmanager
def train_rehydrator(params: Params, target, curated: Path, state_dir: Path):
    """The rehydrator for one train step over `curated` (context manager): None when the set holds
    hidden states only or the backend is embedded (`train.entry.train_here` then uses the target
    here); a `VLLMRehydrator` otherwise, its server stopped on exit. Raises ValueError for ranks
    (`train.world_size` > 1) with vllm and no `ingest.rehydrate_url` (each rank would start a
    server), VLLMUnavailable / VLLMError as `VLLMServer.start`."""
    ing = params.ingest
    if ing.rehydrate_backend == "embedded" or not holds_tokens_only(curated):
        yield None
        return
    if params.train.world_size > 1 and not ing.rehydrate_url:
        raise ValueError(f"{params.train.world_size} ranks rehydrate online through vLLM: set ingest.rehydrate_url to "
                         "one extraction server they share (or rehydrate_backend: embedded)")
    with rehydrator_for(params, target, state_dir, step="train") as r:
        yield r


def remote_shards(train: TrainParams, root: Path) -> RemoteShards | None:
    """Shards the workspace `root` lacks, fetched from its DVC remote into `data/work/shard-cache`,
    bounded by `train.shard_cache_mb` (`train`: params.train); None when `root` is not a DVC
    repository (the shards must then be here)."""
    if not (Path(root) / ".dvc").is_dir():
        return None
    return RemoteShards(root, Workspace(root).work / "shard-cache", int(train.shard_cache_mb * 2**20))
