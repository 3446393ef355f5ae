"""The TIDE cycle's steps, top to bottom: curate → train → evaluate → register → deploy.

Plain functions over paths (never tensors), so a step can run in another process, pool or
machine. Three routes call them and nothing else: the Prefect flows (the project's `flows/`), the
DVC stages (`tidespec stage ...`, what `dvc repro` runs) and the demo. Models come from
`runtime`, paths from `workspace`, the replay harness from `engine.replay`, the per-profile window
from `tuning`; the adapters (`adapters.registry` MLflow, `adapters.versioning` DVC,
`adapters.orchestrate` Prefect, `adapters.sagemaker_*`) sit below this file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Literal

from ..adapters import remote_snapshots, torchrun, versioning
from ..adapters import sagemaker_deploy as smd
from ..adapters.orchestrate import train_on_pool
from ..adapters.sagemaker_train import preview_request, train_on_sagemaker
from ..capture import curate as curate_mod
from ..capture.curate import write_suffix_corpus
from ..capture.snapshots import list_snapshots
from ..config import Params, TrainParams, load_params
from ..models.load import get_target
from ..train.entry import check, skip_reason, train_here
from ..workspace import Workspace
from .deploy.local import deploy_champion, deploy_class_champions, notify_server
from .train_data import remote_shards, train_rehydrator

log = logging.getLogger(__name__)


# -- params -----------------------------------------------------------------------------------
def freeze_params(ws: Workspace, params_path: str | Path) -> tuple[Params, Path]:
    """Read params once for a cycle and freeze them: the bytes of `params_path` (a missing
    `params.yaml`: the defaults, as `load_params` says) are copied once to
    `ws.work/params-<sha>.yaml` (named by the validated params' sha, written by rename) and validated
    from that copy, the file every step of the run loads (and the `tide-train` pool's run, through
    its params_path). The file's own bytes, not a re-dump: validation sees exactly the keys the user
    set. An edit of params.yaml during a cycle then changes nothing in it, and the `params_sha` it
    registers describes the params its training used. Returns (params, frozen file). Raises as
    `load_params` (naming `params_path`)."""
    src = Path(params_path)
    try:
        raw = src.read_bytes()
    except FileNotFoundError:
        load_params(src)  # the defaults for a missing params.yaml; any other missing path raises
        raw = b"{}\n"
    ws.work.mkdir(parents=True, exist_ok=True)
    tmp = ws.work / f".params-{os.getpid()}.yaml.tmp"
    tmp.write_bytes(raw)
    try:
        params = load_params(tmp)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, ValueError):  # name the user's file, not the copy
            raise ValueError(str(e).replace(str(tmp), str(src))) from None
        raise
    out = ws.work / f"params-{params.sha()}.yaml"
    os.replace(tmp, out)
    return params, out


# -- curate -----------------------------------------------------------------------------------
def nothing_new(ws: Workspace, target_id: str, params: Params | None = None) -> str | None:
    """Why a cycle has nothing to do (None: go ahead): no sealed snapshot of `target_id` that the
    last completed cycle did not already curate (with `params.curate.fleet`, those of every replica
    on the DVC remote count too: `fleet_snapshots`). A scheduled run then skips instead of
    retraining on the same data. Raises as `remote_snapshots.RemoteIndex` (fleet only)."""
    snaps = {s.name for s in list_snapshots(ws.snapshots, target_id)}
    if params is not None and params.curate.fleet:
        snaps |= set(fleet_snapshots(ws, target_id))
    if not snaps:
        return f"no sealed snapshots for target {target_id[:12]} under {ws.snapshots} (capture traffic first)"
    done = set(json.loads(ws.last_cycle.read_text())["snapshots"]) if ws.last_cycle.exists() else set()
    if snaps <= done:
        return f"no snapshot newer than the last cycle's ({len(done)} curated); pass force=True to retrain anyway"
    return None


def mark_done(ws: Workspace, curated: Path, params: Params | None = None) -> None:
    """Record the snapshots of a completed cycle's curated set (read by `nothing_new`); with
    `params.curate.fleet`, also on the DVC remote for the fleet threshold (the newest window snapshot:
    `remote_snapshots.RemoteIndex.mark_cycle`)."""
    idx = json.loads(Path(curated).read_text())
    if params is not None and params.curate.fleet and idx["snapshots"]:
        remote_snapshots.RemoteIndex(ws.root).mark_cycle(idx["target_id"], Path(idx["snapshots"][-1]).name)
    names = sorted({Path(s).name for s in idx["snapshots"] + idx.get("replay_snapshots", [])})
    prev = json.loads(ws.last_cycle.read_text())["snapshots"] if ws.last_cycle.exists() else []
    tmp = ws.last_cycle.with_suffix(".tmp")
    tmp.write_text(json.dumps({"snapshots": sorted(set(prev) | set(names))}))
    os.replace(tmp, ws.last_cycle)


def fleet_snapshots(ws: Workspace, target_id: str) -> dict[str, dict]:
    """{snapshot id: manifest} of every replica's snapshots of `target_id` listed on the DVC remote of
    `ws.root` (`remote_snapshots.list_remote_snapshots`), oldest first. Raises as `RemoteIndex`."""
    return {m["snapshot_id"]: m for m in remote_snapshots.list_remote_snapshots(ws.root, target_id)}


def pull_window(ws: Workspace, params: Params, target_id: str) -> list[str]:
    """Pull from the DVC remote the snapshots of the curate window (the newest `curate.window` of
    the target, local or DVC-tracked, by snapshot id: ids are UTC seal times) that retention left on
    the remote only (a `<id>.dvc` pointer, no local copy); older remote-only snapshots stay there.
    With `curate.fleet`, the window is taken across every replica's snapshots on the remote
    (`fleet_snapshots`), and the pointers of the ones it needs are rebuilt here from their manifests
    first (`remote_snapshots.restore_pointer`: `dvc repro` and the lineage then read them as if
    sealed here). Returns the ids pulled ([] outside a DVC repo). Raises VersioningError when the
    pull fails."""
    d = ws.snapshots / target_id
    if not (ws.root / ".dvc").is_dir() or not (d.is_dir() or params.curate.fleet):
        return []
    fleet = fleet_snapshots(ws, target_id) if params.curate.fleet else {}
    ids = set(fleet) | {p.name for p in d.glob("*") if (p / "snapshot.json").exists()}  # sealed here
    ids |= {p.name[: -len(".dvc")] for p in d.glob("*.dvc")}  # tracked, local or not
    window = sorted(ids)[-params.curate.window:]
    for s in window:
        if s in fleet and not (d / f"{s}.dvc").exists() and not (d / s / "snapshot.json").exists():
            remote_snapshots.restore_pointer(fleet[s], ws.snapshots)
    missing = [s for s in window if not (d / s / "snapshot.json").exists()]
    if missing:
        log.info("pulling %d snapshot(s) of the curate window from the DVC remote: %s", len(missing), missing)
        versioning.pull(ws.root, [d / f"{s}.dvc" for s in missing])
    return missing


def step_curate(ws: Workspace, params: Params, target_id: str) -> dict:
    """Curate the newest snapshots into `ws.curated` (those of the window that retention left on the
    DVC remote only, or with `curate.fleet` that other replicas sealed, are pulled first:
    `pull_window`); previous index (if any) gives the drift."""
    pulled = pull_window(ws, params, target_id)
    prev = ws.curated.with_name("curated.prev.json")
    if ws.curated.exists():
        os.replace(ws.curated, prev)
    r = curate_mod.curate(ws.snapshots, target_id, params.curate, ws.curated, previous=prev)
    return {"curated": str(r.path), "num_train": r.num_train, "num_val": r.num_val,
            "num_holdout": r.num_holdout, "holdout": str(r.holdout), "num_tokens": r.num_tokens,
            "dropped": r.dropped, "drift_jsd": r.drift_jsd, "num_replay": r.num_replay,
            "holdout_split": params.curate.holdout_split, "pulled": pulled}


# -- train ------------------------------------------------------------------------------------
TrainRoute = Literal["sagemaker", "work_pool", "torchrun", "here"]


def train_route(train: TrainParams, inside: bool = False) -> TrainRoute:
    """Where a train step runs, decided here and only here (`train_candidate`, the pool's flow and
    `tidespec stage train --dry-run` all ask it): a SageMaker training job (`train.sagemaker`), the
    `tide-train` deployment on a Prefect work pool (`train.work_pool`), `train.world_size` ranks
    under torchrun (embedded backend, more than one rank, not already a rank), else here.
    `inside`: this process is already a remote route's run (the pool's flow run): it does not leave."""
    if not inside and train.sagemaker:
        return "sagemaker"
    if not inside and train.work_pool:
        return "work_pool"
    if train.world_size > 1 and train.backend == "embedded" and "WORLD_SIZE" not in os.environ:
        return "torchrun"
    return "here"


def train_candidate(ws: Workspace, params: Params, curated: Path, init: Path | None, out: Path, *,
                    params_path: Path | None = None, here: bool = False, progress=None) -> dict:
    """The one train entry (the flow, `tidespec stage train` / `dvc repro`, and the `tide-train`
    deployment all call it): train a candidate from the curated index into `out`, warm-started from
    `init`, on the route `train_route` picks (`here=True`: the pool's own run, which trains in this
    process; `params_path`: the file a pool's run loads, needed for `train.work_pool`), once the
    checks of `train.entry.check` pass; each route is one call into the layer that runs it. Then
    the global suffix tree's corpus is written beside the draft (`capture.curate.write_suffix_corpus`),
    so registering, promoting, rolling back and deploying the draft move both. Returns the trainer's
    metrics plus `suffix_corpus/*`, or {"skipped": reason} (too few new tokens: the champion keeps
    serving). Raises SpecForgeUnavailable before loading anything when the backend cannot run here,
    FileNotFoundError for a missing curated index, ValueError for another target's set,
    OrchestrationError / SageMakerTrainingFailed / RanksFailed from the other routes."""
    curated, out, init = Path(curated), Path(out), Path(init) if init else None
    route = train_route(params.train, inside=here)
    if route == "work_pool" and params_path is None:
        raise ValueError("train.work_pool is set: pass params_path (the pool's run loads params from it)")
    shards = remote_shards(params.train, ws.root)
    if reason := check(params, curated, route):
        return {"skipped": reason}
    if route == "sagemaker":  # a SageMaker training job: data and draft travel through S3
        m = train_on_sagemaker(params, curated, init, out)
    elif route == "work_pool":  # its own deployment on that pool (paths on a shared file system)
        m = train_on_pool(params.train.work_pool, _pool_run(ws, curated, init, out, params_path), out)
    elif route == "torchrun":
        m = torchrun.train_ranks(params, ws.root, curated, init, out)
    else:  # loaded once per process (`get_target`), the set checked against its id already
        target, _ = get_target(params)
        with train_rehydrator(params, target, curated, ws.state) as rehydrator:
            m = train_here(params, target, curated, init, out, progress=progress, rehydrator=rehydrator,
                           shards=shards)
    if "skipped" not in m and (out / "model.safetensors").exists():
        m |= write_suffix_corpus(curated, out, params.engine.suffix.max_tokens, shards.locate if shards else None)
    return m


def _pool_run(ws: Workspace, curated: Path, init: Path | None, out: Path, params_path: Path) -> dict:
    """The `tide-train` flow run's parameters: paths on a file system both pools see."""
    return {"root": str(ws.root), "params_path": str(Path(params_path).resolve()), "curated": str(curated),
            "init": str(init) if init else None, "out": str(out)}


def train_plan(ws: Workspace, params: Params, curated: Path, init: Path | None, out: Path) -> dict:
    """Where and how `train_candidate` would train (`train_route`), computed without training or
    calling a service (`tidespec stage train --dry-run`): {"route": "sagemaker", "request": the
    CreateTrainingJob request}, {"route": "work_pool", ...}, {"route": "torchrun", "command": [...]}
    or {"route": "here", ...}. Raises as `sagemaker_train.preview_request`."""
    t = params.train
    route = train_route(t)
    if route == "sagemaker":
        return {"route": route, "request": preview_request(params, Path(curated), Path(init) if init else None)}
    if route == "work_pool":
        return {"route": route, "work_pool": t.work_pool, "deployment": "tide_train/tide-train",
                "world_size": t.world_size}
    where = {"backend": t.backend, "device": t.device, "precision": t.precision, "world_size": t.world_size}
    if reason := skip_reason(params.train, Path(curated)):
        where["skipped"] = reason  # too few new tokens: the real run would stop here
    if route == "torchrun":
        spec, _, run_id = torchrun.rank_files(out)
        return {"route": route, **where, "command": torchrun.argv(t, spec, run_id)}
    return {"route": route, **where}


# -- evaluate ---------------------------------------------------------------------------------
def lineage(curated: Path, snapshot_rev: str = "") -> dict[str, str]:
    """Data lineage of a curated set, however the cycle was started: `snapshot_revs` (JSON
    {snapshot id: DVC rev} of every snapshot the set was drawn from, window and replay; the rev is
    the `.dvc` file's content md5, or `untracked:<sha256 of the manifest>` for a snapshot DVC does
    not track), `snapshot_rev` (the triggering event's rev, else the newest window snapshot's) and
    `holdout_split` (how the gate's holdout was split off: `curate.holdout_split`).
    Raises FileNotFoundError for a missing index."""
    idx = json.loads(Path(curated).read_text())
    base = Path(curated).parent
    revs = {}
    for rel in idx["snapshots"] + idx.get("replay_snapshots", []):
        snap = (base / rel).resolve()
        if snap.with_name(snap.name + ".dvc").exists():
            revs[snap.name] = versioning.snapshot_rev(snap.parent, snap)
        elif not (snap / "manifest.jsonl").exists():
            raise FileNotFoundError(f"snapshot {snap.name} of {curated} is gone and DVC does not track it: "
                                    "restore it (tidespec snapshots pull) or curate again")
        else:
            manifest = hashlib.sha256((snap / "manifest.jsonl").read_bytes()).hexdigest()[:16]
            revs[snap.name] = f"untracked:{manifest}"
    if not revs:
        raise ValueError(f"{curated} names no snapshot: no data lineage; curate sealed snapshots first")
    newest = Path(idx["snapshots"][-1]).name if idx["snapshots"] else ""
    return {"snapshot_rev": snapshot_rev or revs.get(newest, ""), "snapshot_revs": json.dumps(revs, sort_keys=True),
            "holdout_split": idx.get("holdout_split", "random")}


def step_deploy(ws: Workspace, tracking_uri: str, target_id: str, params: Params | None = None) -> dict:
    """Local deploy: materialise the registry champion at `ws.champion` (atomic swap) and each workload
    class's own at `ws.class_champions/<class>` (`deploy_class_champions`), then ask a
    running `tidespec serve` ($TIDESPEC_SERVER_URL) to hot-swap to it (`notify_server`: never
    fails the cycle; a server that is down loads the champion when it starts). Then each SageMaker
    profile in `deploy.sagemaker.on_promote` gets it (blue/green; "unchanged" when the endpoint
    already serves this draft). Raises as `deploy_endpoint` (a failed endpoint update rolls back on
    AWS; the local deploy has happened)."""
    dep = deploy_champion(tracking_uri, target_id, ws.champion)
    if classes := deploy_class_champions(tracking_uri, target_id, ws.class_champions):
        dep["classes"] = classes  # the server's class watcher installs (or drops) them
    if dep["version"] is not None:
        dep["server"] = notify_server(ws.champion)
        sm = params.deploy.sagemaker if params is not None else None
        if sm is not None and sm.on_promote:
            art = smd.check_draft(ws.champion, target_id)
            dep["sagemaker"] = {prof: smd.deploy_endpoint(params, prof, art, target_id, lock_dir=ws.work)
                                for prof in sm.on_promote}
    return dep
