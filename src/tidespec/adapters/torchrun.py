"""torchrun: start the train step's ranks (`torch.distributed.run`, PyTorch's elastic launcher).

`torchrun --nproc-per-node N [--nnodes M --rdzv-backend c10d --rdzv-endpoint host:port --rdzv-id
ID] --max-restarts R -m tidespec.steps.rank SPEC`: every rank runs the same train step
(`steps.rank`); torchrun sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT, restarts
every rank (up to R times) when one dies, and exits non-zero when they fail for good. On one node
it uses a free local port for the rendezvous. See https://pytorch.org/docs/stable/elastic/run.html.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..config import Params, TrainParams
from ..errors import TidespecError
from ..train import ranks
from .process import free_port, launch, log_tail, reap, stop

RANK_MODULE = "tidespec.steps.rank"


class RanksFailed(TidespecError):
    """torchrun's ranks failed (after its restarts); the message holds the log's tail."""


def argv(tparams: TrainParams, spec: Path, run_id: str, port: int | None = None) -> list[str]:
    """The torchrun command line for `tparams` (nproc_per_node, nnodes, rdzv_endpoint,
    max_restarts) running `steps.rank` on `spec`; one node rendezvous on 127.0.0.1:`port` (a
    free port when None)."""
    endpoint = tparams.rdzv_endpoint if tparams.nnodes > 1 else f"127.0.0.1:{port or free_port()}"
    return ranks.torchrun_argv(tparams.nproc_per_node, tparams.nnodes, tparams.max_restarts, endpoint, run_id,
                               ["-m", RANK_MODULE, str(spec)])


def rank_files(out: Path) -> tuple[Path, Path, str]:
    """(spec file, log file, rendezvous id) of the ranks that train into `out`: `<out>.ranks.json`,
    `<out>.ranks.log` beside it, and a 12-hex id of its resolved path."""
    out = Path(out).resolve()
    run_id = hashlib.sha256(str(out).encode()).hexdigest()[:12]
    return out.with_name(out.name + ".ranks.json"), out.with_name(out.name + ".ranks.log"), run_id


def train_ranks(params: Params, root: Path, curated: Path, init: Path | None, out: Path) -> dict:
    """Train as `train.world_size` ranks under torchrun: the spec file every rank's `steps.rank`
    reads ({"params", "root": the workspace, "curated", "init", "out"}, `rank_files`), then the
    ranks, their output in the log beside `out`. The caller has checked the set and the backend
    (`train.entry.check`). Returns rank 0's metrics (`out`/train_metrics.json). Raises RanksFailed
    when the ranks fail (after `train.max_restarts` restarts; a rerun resumes from the last
    training state)."""
    out = Path(out).resolve()
    spec, log, run_id = rank_files(out)
    spec.write_text(json.dumps({"params": params.model_dump(mode="json"), "root": str(Path(root).resolve()),
                                "curated": str(Path(curated).resolve()),
                                "init": str(Path(init).resolve()) if init else None, "out": str(out)}))
    run(argv(params.train, spec, run_id), log)
    return json.loads((out / "train_metrics.json").read_text())


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Run torchrun `cmd` to the end, its output (every rank's) appended to `log`. Raises
    RanksFailed naming the exit code and the log's last lines."""
    proc = launch(cmd, log, env=env)
    try:
        code = proc.wait()
    except BaseException:  # interrupted (Ctrl-C, a cancelled flow run): no rank outlives its step
        stop(proc.pid)
        raise
    reap(proc.pid)
    if code != 0:
        raise RanksFailed(f"torchrun exited with {code} (train.nproc_per_node / nnodes ranks); log {log}:\n"
                          f"{log_tail(log, 30)}")
