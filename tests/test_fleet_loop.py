"""The loop across machines, end to end on real servers (docs/fleet.md): three replicas that share no
disk — `tidespec serve --backend vllm` and an embedded `tidespec serve` (both stable), and an embedded
`tidespec serve` with `serve.canary: true`, each in its own root and repo — and a fleet worker in a
fourth, all on one DVC remote on S3 (moto), one MLflow registry and one Prefect server.

Every replica captures (the vLLM front door text, rehydrated by its machine's `tide-capture` with the
shipped embedded prefill — vLLM's own extraction is test_vllm_real's —, the embedded ones hidden states)
and publishes its seals with manifests; no two reach `capture.fleet_min_tokens` together. The fleet's
seals fire the threshold event; `tidespec fleet deploy`'s
cycle runs on the worker from its own workspace, trains on the three replicas' snapshots and, with
`deploy.rollout: canary`, sets the `canary` alias: the canary replica serves the new version, the stable
ones keep the champion. Then the traffic shifts to another workload (prompts of other tokens) on every
replica at once: the `tide-rollout` deployment on the worker judges the canary against the stable side on
the same windows of the new traffic and promotes it; both stable replicas follow, vLLM in place (the
same server), its own counters giving τ before and after; the shifted traffic again on every replica
leaves each on the new champion, and the registry records no rollback by the rollout or by a replica's
live guard (every replica checks each second here). A worse version put under the canary alias is
rolled back: it never reaches a stable replica, the champion stays. No file copied by hand between the
roots."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import boto3
import httpx
import pytest
import yaml

from conftest import (
    copy_prefect_project,
    health,
    live_tau,
    make_vllm_tiny_target,
    random_draft,
    shipped_params,
    vllm_python_or_skip,
    wait_until,
)

pytestmark = pytest.mark.services
POOL = "tidespec-fleet-loop"
SEAL = 1800  # tokens per seal on each replica (60 requests of 31 record tokens, 33 by usage)
FLEET = 4200  # more than two replicas' seals (≤ 2 × 60 × 33): the cycle needs all three
STABLE = ("vllm", "embedded")  # the replicas that follow the champion alias


def _counters(url: str):
    from tidespec.backends.vllm import parse_metrics
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10).text)


def _traffic(url: str, seed: int, n: int, vocab: tuple[int, int] = (6, 60)) -> None:
    """`n` requests of (8 + 1) prompt + 24 generated tokens: word-tokenizer text of the words
    t<lo>..t<hi-1> (`vocab`), a learnable workload; another range is another workload."""
    import torch
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        words = " ".join(f"t{i}" for i in torch.randint(*vocab, (8,), generator=g).tolist())
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": words, "max_tokens": 24,
                                                      "temperature": 0, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text


def _params(tdir: Path, replica: str, canary: bool) -> dict:
    raw = shipped_params(tdir)  # the shipped defaults, as make demo-vllm's
    raw["capture"] |= {"seal_min_tokens": SEAL, "fleet_min_tokens": FLEET, "keep_local_snapshots": 3}
    raw["curate"] |= {"fleet": True, "window": 3}  # one seal of each replica
    raw["serve"] |= {"watch_champion_s": 0.5, "served_model_name": "tiny", "live_stats_s": 1.0,
                     "champion_source": "registry", "replica_id": replica, "canary": canary}
    if replica != "vllm":  # the embedded guard every 1 s (vLLM's runs with its counters, every live_stats_s)
        raw["serve"]["health_check_s"] = 1.0
    raw["engine"]["adaptive"] = False  # k fixed, and the draft alone proposes (the suffix proposer, whose drafts
    raw["engine"]["suffix"]["enabled"] = False  # a version's counters leave out, would take the repeated prompts)
    raw["deploy"] = {"rollout": "canary", "canary_windows": 1,
                     "sagemaker": {"role_arn": "arn:aws:iam::123456789012:role/r", "s3_prefix": "s3://bucket/tidespec",
                                   "profiles": {"gpu": {"engine": "sglang", "instance_type": "ml.g6e.2xlarge"}}}}
    return raw


def _serve(root: Path, args: list[str], env: dict, log: Path) -> tuple[str, subprocess.Popen]:
    from tidespec.adapters.services import free_port
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tidespec.cli", "serve", *args, "--root", str(root), "--params",
                             str(root / "params.yaml"), "--port", str(port)], cwd=root, env=env,
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return f"http://127.0.0.1:{port}", proc


def _samples(uri: str, tid: str) -> str:
    """Each side's replica samples since the canary started (what a window is cut from): for a failure's message."""
    from tidespec.adapters import registry
    from tidespec.adapters.registry import rollout
    can, champ = registry.canary(uri, tid), registry.champion(uri, tid)
    since = rollout._since(uri, tid, can) if can else 0
    def side(v) -> dict:  # {replica: [(ms after the start, drafts so far)]}
        return {r: [(t - since, c.num_drafts) for t, c in ss]
                for r, ss in rollout.replica_samples(uri, v.run_id, since).items()}
    return "; ".join(f"{name} v{v.version}: {side(v)}" for name, v in (("canary", can), ("champion", champ)) if v)


def _decided(uri: str, tid: str, version: str) -> str:
    """The rollout's verdict on canary `version` once a window is judged (the registry untouched), or the
    one the worker's scheduled `tide-rollout` recorded on it when that run acted first (every 300 s: the
    alias is gone, the version's latest decision says which way); fails with both sides' samples."""
    from tidespec.adapters import registry
    from tidespec.adapters.registry import rollout

    def judged():
        d = rollout.decide(uri, tid, windows=1, act=False)
        if d.verdict == rollout.NO_CANARY:
            done = registry.version_tags(uri, tid, version).get("decision")
            return {"promoted": rollout.PROMOTE, "rolled_back": rollout.ROLL_BACK}.get(done)
        return d.verdict if d.verdict != rollout.WAIT else None
    try:  # every 2 s: a decision reads every replica's counter history (~50 registry calls)
        return wait_until(judged, 120, "a window of both replicas' counters", poll_s=2.0)
    except AssertionError as e:
        raise AssertionError(f"{e}: {_samples(uri, tid)}") from None


def _run_rollout(api_url: str, name: str) -> None:
    """A run of the worker's `tide-rollout` deployment now (as the Prefect UI's Run), to its end (its
    scheduled run may have acted first: the registry tells)."""
    from prefect.deployments import run_deployment

    from tidespec.adapters import orchestrate
    with orchestrate.using_api(api_url):
        run = run_deployment(name, timeout=300)
    assert run.state.is_completed(), run.state


def test_a_fleet_learns_from_every_replica_and_rolls_out_canary_first(
        tmp_path, prefect_server, prefect_worker, mlflow_server, moto_server, services_state_dir, monkeypatch):
    python = vllm_python_or_skip()
    from tidespec.adapters import fleet_deploy, orchestrate, registry, services, versioning
    from tidespec.adapters.registry import rollout
    from tidespec.adapters.remote_snapshots import RemoteIndex
    from tidespec.config import load_params
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.models.load import get_target

    for k, v in (services.MOTO_ENV | {"AWS_ENDPOINT_URL": moto_server}).items():
        monkeypatch.setenv(k, v)  # every machine's S3 client: the fleet's remote
    boto3.client("s3", endpoint_url=moto_server).create_bucket(Bucket="fleet")
    remote = "s3://fleet/dvc"
    tdir = make_vllm_tiny_target(tmp_path / "target")
    roots = {"vllm": copy_prefect_project(tmp_path / "vllm"), "embedded": tmp_path / "embedded",
             "canary": tmp_path / "canary"}
    roots["embedded"].mkdir()
    roots["canary"].mkdir()
    for name, root in roots.items():
        (root / "params.yaml").write_text(yaml.safe_dump(_params(tdir, name, name == "canary")))
        versioning.ensure_repo(root, remote, remote_name="fleet", endpoint_url=moto_server)
    uri, api = mlflow_server, prefect_server
    params = load_params(roots["vllm"] / "params.yaml")
    target = get_target(params)[0]
    tid = target.target_id
    _, v1 = registry.log_candidate(uri, tid, save_checkpoint(random_draft(target, 64, seed=1), tmp_path / "d1"),
                                   params={}, metrics={}, tags={"role": "bootstrap"})
    registry.promote(uri, tid, v1, "first draft", allow_unevaluated=True)

    # the vLLM machine's own worker ingests its text (pool tidespec: prefect.yaml's tide-capture, in its root);
    # the fleet's cycle and rollout run on a worker in a workspace of its own (`tidespec fleet deploy`)
    orchestrate.deploy(roots["vllm"], api, names=("tide-capture",))
    home = tmp_path / "worker-home"
    monkeypatch.setenv(fleet_deploy.HOME_ENV, str(home))
    r = subprocess.run([sys.executable, "-m", "tidespec.cli", "fleet", "deploy", "--remote", remote, "--endpoint-url",
                        moto_server, "--pool", POOL], cwd=roots["vllm"], env=os.environ | {"PREFECT_API_URL": api},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    services.up(services_state_dir, which=("prefect", "mlflow", "moto", "worker"), pools=(POOL,))
    env = os.environ | {"PREFECT_API_URL": api, "MLFLOW_TRACKING_URI": uri}
    procs = {}
    try:
        urls = {}
        urls["vllm"], procs["vllm"] = _serve(roots["vllm"], ["--backend", "vllm", "--vllm-python", python], env,
                                             tmp_path / "vllm.log")
        for k in ("embedded", "canary"):
            urls[k], procs[k] = _serve(roots[k], [], env, tmp_path / f"{k}.log")
        for k in urls:
            h = wait_until(lambda k=k: health(urls[k]), 400, f"{k} /health", procs[k])
            assert h["draft_version"] == v1 and h["replica_id"] == k
        assert health(urls["canary"])["canary"] is True and health(urls["vllm"])["engine"] == "vllm"

        # traffic on all three: each seals ~1,800 tokens, the fleet's ~5,400 pass fleet_min_tokens → a cycle. The
        # stable embedded replica gets other prompts of the workload (curate keeps one record per prompt)
        for k in urls:
            _traffic(urls[k], seed=10 if k == "embedded" else 0, n=60)
        before = _counters(urls["vllm"])  # vLLM's own counters, v1 (random draft)
        assert before is not None and before.num_drafts > 0
        wait_until(lambda: live_tau(uri, tid, v1) == before.acceptance_length, 60, "v1's live τ in MLflow")
        index = RemoteIndex.at(remote, endpoint_url=moto_server)

        def sealed():  # each replica's seal on the remote: the embedded one's own, the front door's by tide-capture
            seals = {m["snapshot_id"]: m["replica_id"] for m in index.manifests(tid)}
            return seals if set(seals.values()) == set(roots) else None
        seals = wait_until(sealed, 600, "a seal of each replica on the DVC remote")
        assert len(seals) == 3, seals
        sizes = {m["replica_id"]: (m["num_tokens"], m["num_bytes"]) for m in index.manifests(tid)}
        can = wait_until(lambda: registry.canary(uri, tid), 600, "the fleet cycle's candidate under the canary alias")
        assert set(json.loads(can.tags["snapshot_revs"])) == set(seals)  # the window: every replica's seal
        assert registry.champion(uri, tid).version == v1  # canary first: the champion has not moved
        mark = wait_until(lambda: index.cycle_mark(tid), 120, "the cycle's mark on the remote (its last step)")
        assert mark["through"] == max(seals)  # the fleet threshold counts from the newest snapshot it curated
        wroot = home / "tide-cycle"  # the worker's own workspace, not a replica's
        assert (wroot / "data" / "work" / "last_cycle.json").exists() and not (roots["vllm"] / "data" / "work").exists()

        wait_until(lambda: health(urls["canary"])["draft_version"] == can.version, 60, "the canary to serve it",
                   procs["canary"])
        t = {"canary alias": int(can.tags["canary_since"]) / 1000, "canary serving": time.time()}
        assert all(health(urls[k])["draft_version"] == v1 for k in STABLE)  # the stable ones wait for the decision

        # the traffic shifts to another workload (words t160..t319, none in any training prompt) on every replica
        # at once: the same new traffic on both sides' windows (≥ 100 drafts a side), on which the worker's
        # tide-rollout promotes the canary. After their seals each replica has < seal_min_tokens left to take
        # (vLLM ≤ 5 exchanges + 12 + 8 + 8 + 12, the embedded ones ≤ 1 + 16 + 8 + 16): no further seal, so no
        # second cycle moves the canary meanwhile
        for k in urls:
            _traffic(urls[k], seed=1, n=12 if k == "vllm" else 16, vocab=(160, 320))
        assert _decided(uri, tid, can.version) == rollout.PROMOTE
        t["decided"] = time.time()
        _run_rollout(api, "tide_rollout/tide-cycle")
        t["promoted"] = time.time()
        assert registry.champion(uri, tid).version == can.version and registry.canary(uri, tid) is None
        for k in STABLE:
            wait_until(lambda k=k: health(urls[k])["draft_version"] == can.version, 400, f"{k} to follow", procs[k])
        t["fleet serving"] = time.time()
        at_swap = _counters(urls["vllm"])  # loaded in place: the same server, its counters went on
        assert at_swap.num_drafts >= before.num_drafts
        _traffic(urls["vllm"], seed=0, n=8)  # the first burst's prompts again, now on the new draft
        after = _counters(urls["vllm"]) - at_swap
        assert after.num_drafts > 0 and after.acceptance_length > before.acceptance_length, (before, after)
        wait_until(lambda: live_tau(uri, tid, can.version) == after.acceptance_length, 60,
                   f"v{can.version}'s live τ in MLflow")
        from tidespec.steps.tuning import live_windows  # the endpoint profiles' windows, tuned from vLLM's counts
        want = {p: str(w["k"]) for p, w in live_windows(params.deploy.sagemaker, after.per_position_rate,
                                                           after.num_drafts).items()}
        assert set(want) == {"gpu", "trn2"}
        wait_until(lambda: {p: registry.version_tags(uri, tid, can.version).get(f"live_tuned_k.{p}")
                            for p in want} == want, 60, "the live-tuned windows on the version")
        for k in urls:  # the shifted workload again, now that every replica serves the new champion
            _traffic(urls[k], seed=3, n=8, vocab=(160, 320))
        time.sleep(3)  # three rounds of every replica's guard (serve.health_check_s, live_stats_s: 1 s)
        assert all(health(urls[k])["draft_version"] == can.version for k in urls)

        # a worse version under the canary alias: the canary serves it, the windows roll it back
        _, bad = registry.log_candidate(uri, tid, save_checkpoint(random_draft(target, 64, seed=5), tmp_path / "d3"),
                                        {}, {"acceptance_length": 1.0}, {"lossless": "True"})
        registry.start_canary(uri, tid, bad, "a worse draft, by hand")
        wait_until(lambda: health(urls["canary"])["draft_version"] == bad, 60, "the canary to serve it")
        for k in urls:
            _traffic(urls[k], seed=2, n=12 if k == "vllm" else 16)
        assert _decided(uri, tid, bad) == rollout.ROLL_BACK
        _run_rollout(api, "tide_rollout/tide-cycle")
        assert registry.canary(uri, tid) is None
        assert registry.champion(uri, tid).version == can.version
        wait_until(lambda: health(urls["canary"])["draft_version"] == can.version, 60, "the canary back on it")
        assert all(health(urls[k])["draft_version"] == can.version for k in STABLE)  # never loaded the worse one
        # the shifts rolled nothing back: no rollback recorded by a replica's guard or by the rollout, the one
        # rollback is the worse canary's (the vLLM replica's guard, with no hidden states, could only reload)
        trail = {v: registry.decisions(uri, tid, v) for v in (v1, can.version, bad)}
        rolled = {v: [d for d in ds if " rolled_back: " in d] for v, ds in trail.items()}
        assert not rolled[v1] and not rolled[can.version] and len(rolled[bad]) == 1, trail
        print(f"vLLM's counters: v{v1} τ {before.acceptance_length:.3f}; "
              f"v{can.version} τ {after.acceptance_length:.3f}")
        print("s after the canary alias: " + ", ".join(f"{k} {v - t['canary alias']:.1f}" for k, v in t.items()))
        print("capture per replica: " + ", ".join(f"{r} {n} tokens {b} bytes ({b / n:.0f} B/token)"
                                                  for r, (n, b) in sorted(sizes.items())))
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(120)
        services.down(services_state_dir, which=(f"worker-{POOL}",))
    for k in roots:
        log = (tmp_path / f"{k}.log").read_text()
        assert "Traceback" not in log, log
