"""One rank of the train step under torchrun (`adapters.torchrun` starts `python -m
tidespec.steps.rank SPEC` on every rank). SPEC: a JSON file {"params": the cycle's params,
"root": the workspace, "curated", "init", "out"} written by `adapters.torchrun.train_ranks`. Each rank runs
`train.entry.train_here` with the target; rank 0 writes the candidate and its train_metrics.json."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..config import Params
from ..models.load import get_target
from ..train import ranks
from ..train.entry import train_here
from .train_data import remote_shards, train_rehydrator


def main(spec_path: str) -> None:
    """Train this rank from the spec file at `spec_path` (JSON, see the module docstring), then
    leave the process group. Raises as `train_here` (FileNotFoundError for a missing curated index,
    ValueError for another target's set); torchrun reports a raising rank and stops the others."""
    spec = json.loads(Path(spec_path).read_text())
    params = Params.model_validate(spec["params"])
    target, _ = get_target(params)
    curated = Path(spec["curated"])
    try:
        with train_rehydrator(params, target, curated, Path(spec["out"]).parent) as rehydrator:
            train_here(params, target, curated, Path(spec["init"]) if spec["init"] else None, Path(spec["out"]),
                       rehydrator=rehydrator, shards=remote_shards(params.train, Path(spec["root"])))
    finally:
        ranks.close()


if __name__ == "__main__":
    main(sys.argv[1])
