"""The cycle deployed for a worker on another machine (docs/fleet.md, A worker on another machine):
its flow runs start in a clean directory of a machine that shares no file with the servers or the
replicas, and reach everything through the fleet's shared engines (Prefect, the MLflow registry,
the DVC remote).

`deploy_fleet` (what `tidespec fleet deploy` runs) publishes the deployment's **bundle** to the DVC
remote, one JSON object `<remote>/tidespec/deployments/<name>/<bundle>.json` = {"name", "published",
"files": {"params.yaml": text, "flows/<flow>.py": text, ...}} named by the sha256 of its files (a
new params.yaml is a new bundle; an old one stays as it was), then deploys prefect.yaml's
`tide-cycle` entry (schedule, event trigger, concurrency limit: unchanged) as deployment `<name>`
on work pool `pool`, with one `pull` step: `prepare_worker`, by import path, naming the remote and
the bundle. On the worker, Prefect runs that step in the run's clean directory: it prepares the
worker's own workspace, `<worker home>/<name>` (git + DVC repo whose default remote is the fleet's;
the bundle's params.yaml and flows/ written in), and returns it as the `directory` Prefect moves
the run into, so the entrypoint (`flows/cycle.py:tide_cycle`), `root: "."` and `params_path:
params.yaml` are the workspace's. The cycle then curates from the remote's manifests
(`curate.fleet`), warm-starts from the registry's champion and registers in MLflow as anywhere
else; what its deploy step writes stays on the worker's disk (replicas follow the registry).
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import yaml

from ..config import Params, load_params
from ..workspace import private_dir
from . import orchestrate, versioning
from .remote_snapshots import RemoteIndex

DEFAULT_NAME = "tide-cycle"  # the fleet's cycle takes the one-checkout deployment's name: one per server
DEFAULT_POOL = "tidespec-fleet"  # not `tidespec`: the loop machine's own worker (services up) polls that one
PULL_STEP = f"{__name__}.prepare_worker"
HOME_ENV = "TIDESPEC_WORKER_HOME"  # where a worker keeps its workspaces (default ~/.tidespec/worker)
CYCLE_FLOW = "tide_cycle"
ROLLOUT_FLOW = "tide_rollout"  # deployed beside the cycle when deploy.rollout is canary: the canary's decision
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # a deployment name that is also a path component
BUNDLE_FILE = re.compile(r"^(params\.yaml|flows/[A-Za-z0-9_]+\.py)$")  # what a bundle may write on a worker


def fleet_refusal(params: Params) -> str | None:
    """Why `params` cannot run the cycle on a worker that shares no file with anyone (None: it can):
    without `curate.fleet` its window would be the worker's own snapshots (none); `train.work_pool`
    hands a pool's worker paths on a file system both pools see."""
    if not params.curate.fleet:
        return ("curate.fleet is false: a fleet worker seals no snapshot of its own; set curate.fleet: true "
                "(its curate window is then every replica's snapshots on the DVC remote)")
    if params.train.work_pool:
        return (f"train.work_pool {params.train.work_pool!r} hands the train step paths on a file system both pools "
                "see, which a fleet worker shares with no one: unset it (train on the worker) or use train.sagemaker")
    return None


def bundle_files(project: Path, params_path: Path) -> dict[str, str]:
    """What a worker needs beside the installed package: {"params.yaml": the text of `params_path`,
    "flows/<flow>.py": each flow file of `project`/flows}. Raises FileNotFoundError without them."""
    flows = sorted((Path(project) / "flows").glob("*.py"))
    if not flows:
        raise FileNotFoundError(f"no flows/*.py in {project}: run from the tidespec project root")
    return {"params.yaml": Path(params_path).read_text()} | {f"flows/{f.name}": f.read_text() for f in flows}


def publish_bundle(index: RemoteIndex, name: str, files: dict[str, str]) -> str:
    """Store `files` as deployment `name`'s bundle on the remote of `index` (kept when already
    there); returns its id (16 hex digits of the sha256 of the files)."""
    from ..capture.store import utc_now
    bundle = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:16]
    if index.read_doc("deployments", name, f"{bundle}.json") is None:
        index.write_doc({"name": name, "published": utc_now(), "files": files}, "deployments", name, f"{bundle}.json")
    return bundle


def worker_root(name: str, home: str | None = None) -> Path:
    """Deployment `name`'s workspace on this machine: `<home>/<name>`, `home` defaulting to
    $TIDESPEC_WORKER_HOME, else `~/.tidespec/worker`."""
    base = Path(home or os.environ.get(HOME_ENV) or Path.home() / ".tidespec" / "worker").expanduser()
    return base.resolve() / name


def prepare_worker(remote: str, name: str, bundle: str, endpoint_url: str | None = None,
                   home: str | None = None) -> dict[str, str]:
    """The fleet deployment's Prefect `pull` step, run by the worker in each flow run's clean
    directory: make `worker_root(name, home)` a git + DVC repo whose default remote (`fleet`) is
    `remote` (`endpoint_url`: an S3 endpoint other than AWS's), and write in it the files of bundle
    `bundle` (params.yaml, flows/). Returns {"directory": that workspace}: Prefect runs the flow
    there. Idempotent; snapshots, the replay buffer and the last cycle's marks stay between runs.
    Raises OrchestrationError when the remote has no such bundle (deploy again: `tidespec fleet
    deploy`), VersioningError when git/DVC fail."""
    from filelock import FileLock
    if not NAME.match(name):
        raise orchestrate.OrchestrationError(f"deployment name {name!r}: letters, digits, '_', '.', '-'")
    root = private_dir(worker_root(name, home))  # its snapshots hold hidden states
    with FileLock(private_dir(root / ".tidespec") / "prepare.lock"):
        versioning.ensure_repo(root, remote, remote_name="fleet", endpoint_url=endpoint_url)
        doc = RemoteIndex(root).read_doc("deployments", name, f"{bundle}.json")
        if doc is None:
            raise orchestrate.OrchestrationError(
                f"no bundle {bundle} of deployment {name} on the DVC remote {remote}: deploy it again "
                "(tidespec fleet deploy) with the remote this worker reaches")
        for rel, text in doc["files"].items():
            if not BUNDLE_FILE.match(rel):
                raise orchestrate.OrchestrationError(f"bundle {bundle} names {rel!r}: not a file a worker writes")
            _write_if_changed(root / rel, text)
    return {"directory": str(root)}


def _write_if_changed(path: Path, text: str) -> None:
    if path.exists() and path.read_text() == text:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def fleet_deployment(project: Path, name: str, pool: str, pull_step: dict, flows: tuple[str, ...] = (CYCLE_FLOW,)
                     ) -> dict:
    """A prefect.yaml document with one deployment per flow of `flows`: `project`/prefect.yaml's entry
    of that flow (schedule, trigger, concurrency limit, tags) named `name`, on work pool `pool`, with
    `pull_step` as its pull section and the bundle's files as its parameters (`root: "."`,
    `params_path: params.yaml`). Raises OrchestrationError when prefect.yaml deploys no such flow."""
    doc = yaml.safe_load((Path(project) / "prefect.yaml").read_text()) or {}
    deps = []
    for flow in flows:
        base = [d for d in doc.get("deployments") or [] if str(d.get("entrypoint", "")).endswith(f":{flow}")]
        if not base:
            raise orchestrate.OrchestrationError(f"{Path(project) / 'prefect.yaml'} deploys no {flow} flow")
        dep = copy.deepcopy(base[0]) | {"name": name, "pull": [pull_step]}
        dep["work_pool"] = (dep.get("work_pool") or {}) | {"name": pool}
        dep["parameters"] = (dep.get("parameters") or {}) | {"root": ".", "params_path": "params.yaml"}
        deps.append(dep)
    return {k: v for k, v in doc.items() if k != "deployments"} | {"deployments": deps}


def deploy_fleet(project: Path, api_url: str, remote: str, params_path: Path, name: str = DEFAULT_NAME,
                 pool: str = DEFAULT_POOL, endpoint_url: str | None = None, home: str | None = None) -> dict:
    """Deploy the cycle for workers on other machines: publish the bundle (`params_path`, `project`'s
    flows/) to the DVC remote `remote` (an s3:// URL, or an absolute path every machine reaches),
    then `prefect deploy` (against the server at `api_url`) prefect.yaml's tide_cycle entry as
    deployment `tide_cycle/<name>` on `pool`, with `prepare_worker` as its pull step (`home`: the
    workers' workspace root, default theirs: `worker_root`), and with `deploy.rollout: canary` its
    tide_rollout entry as `tide_rollout/<name>` beside it (the canary's decision, run by the same
    workers in the same workspace). Returns {"deployment", "rollout" (None without a canary), "pool",
    "bundle", "pull", "files"}. Raises ValueError for params a fleet worker cannot run
    (`fleet_refusal`), a bad name or remote; OrchestrationError when `prefect deploy` fails."""
    if not NAME.match(name):
        raise ValueError(f"--name {name!r}: letters, digits, '_', '.', '-' (it names the workers' directory too)")
    params = load_params(params_path)
    if why := fleet_refusal(params):
        raise ValueError(f"{params_path}: {why}")
    files = bundle_files(project, params_path)
    bundle = publish_bundle(RemoteIndex.at(remote, endpoint_url), name, files)
    args = {"remote": remote, "name": name, "bundle": bundle}
    args |= {k: v for k, v in (("endpoint_url", endpoint_url), ("home", home)) if v}
    step = {PULL_STEP: args}
    with tempfile.TemporaryDirectory(prefix="tidespec-fleet-") as d:  # prefect deploy reads the flow file there
        shutil.copytree(Path(project) / "flows", Path(d) / "flows", ignore=shutil.ignore_patterns("__pycache__"))
        flows = (CYCLE_FLOW, ROLLOUT_FLOW) if params.deploy.rollout == "canary" else (CYCLE_FLOW,)
        (Path(d) / "prefect.yaml").write_text(yaml.safe_dump(fleet_deployment(project, name, pool, step, flows),
                                                             sort_keys=False))
        orchestrate.deploy(Path(d), api_url)  # every deployment of that file: the cycle (and the rollout)
    return {"deployment": f"{CYCLE_FLOW}/{name}", "rollout": f"{ROLLOUT_FLOW}/{name}" if len(flows) > 1 else None,
            "pool": pool, "bundle": bundle, "pull": [step],
            "files": sorted(files)}
