"""`tidespec serve`: the OpenAI-compatible server on the embedded engine, or the front door before
a vLLM server it starts or an SGLang server. Everything it checks runs first (`serve_preflight`)."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
from pathlib import Path

import typer

from .common import PARAMS, ROOT, app, console, log_to_stderr, ws_of
from .serve_registry import champion_source, registry_loader, registry_rollback, replica_reporter

log = logging.getLogger(__name__)


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
                                                       "behind the front door; loads new champions in place; text "
                                                       "capture) | sglang (the same with SGLang, on a CUDA GPU; or a "
                                                       "front door to your own server with --sglang-url) | llama-cpp "
                                                       "(llama.cpp's llama-server from `make llama-server` on the "
                                                       "target GGUF, the champion converted to EAGLE-3; new champions "
                                                       "blue/green)"),
          sglang_url: str = typer.Option(None, help="your own SGLang server for --backend sglang, e.g. "
                                                    "http://127.0.0.1:30000 (tidespec then neither starts nor "
                                                    "swaps it)"),
          sglang_python: str = typer.Option(None, help="python of SGLang's environment for --backend sglang "
                                                       "(default $TIDESPEC_SGLANG_PYTHON, else "
                                                       ".venv-sglang/bin/python)"),
          vllm_python: str = typer.Option(None, help="python of vLLM's venv for --backend vllm (default "
                                                     "$TIDESPEC_VLLM_PYTHON, else .venv-vllm/bin/python)"),
          publish: bool = typer.Option(True, help="publish each sealed snapshot: dvc add + push, retention, "
                                                  "drift, the tidespec.capture.threshold event that starts "
                                                  "tide-cycle (needs --root to be a DVC repo, as `make demo` "
                                                  "sets up)"),
          api_key: str = typer.Option(None, help="the key of the OpenAI routes, as vLLM's --api-key: a request "
                                                 "without `Authorization: Bearer KEY` gets 401 (/health, /metrics "
                                                 "open unless serve.auth_health_metrics; /admin keeps "
                                                 "$TIDESPEC_ADMIN_TOKEN). Default $TIDESPEC_API_KEY (prefer it: a "
                                                 "flag shows in the process list); neither: no key")):
    """OpenAI-compatible server (/v1/completions, /v1/chat/completions, /health, /metrics,
    /admin/draft with $TIDESPEC_ADMIN_TOKEN; the OpenAI routes with $TIDESPEC_API_KEY or --api-key
    when set) on the target + the served champion draft. With capture,
    each sealed snapshot is published (DVC + the Prefect event that starts a cycle, $PREFECT_API_URL)
    and the champion a cycle deploys is served within serve.watch_champion_s (with
    serve.champion_source: registry, the registry's champion, followed into .tidespec/registry)."""
    import uvicorn

    from ..capture.text import TextCapture
    from ..capture.writer import CaptureWriter
    from ..engine.build import install_suffix_corpus, make_engine
    from ..models.load import get_target, runner_for
    from ..serve.server import ADMIN_TOKEN_ENV, build_app
    from ..workspace import served
    log_to_stderr()  # every swap, rollback and pin is logged with the version served
    p, ws, launch, pub = serve_preflight(root, params, backend=backend, sglang_url=sglang_url,
                                         sglang_python=sglang_python, vllm_python=vllm_python, capture=capture,
                                         publish=publish, max_queue=max_queue, timeout_s=timeout_s,
                                         max_tokens=max_tokens, api_key=api_key)
    p = p.model_copy(update={"serve": p.serve.model_copy(update={"replica_id": p.serve.replica(port)})})
    key = launch.api_key_in(os.environ)
    if launch.backend != "embedded":
        _serve_frontdoor(p, ws, launch, host, port, key)
        return
    hidden, text = capture and p.capture.mode == "hidden", capture and p.capture.mode == "text"
    target, tok = get_target(p)
    champ, classes, follower = champion_source(p, ws, target.target_id)
    writer = (
        CaptureWriter(
            ws.capture_dir(target.target_id),
            target.target_id,
            p.capture,
            snapshots_root=ws.snapshots,
            on_seal=pub,
            detokenize=tok.decode if tok is not None else None,
            replica_id=p.serve.replica_id,  # snapshot ids carry it: unique across the fleet
            unpublished=_unpublished(pub, target.target_id),  # sealed before a kill, never published
        )
        if hidden
        else None
    )
    text_capture = _text_log(TextCapture(ws.text_capture_dir(target.target_id), p.capture),
                             target.target_id, p.capture.seal_min_tokens) if text else None
    runner = runner_for(champ, target)
    engine = make_engine(p.engine, target, runner, capture=writer, **(served(champ) if runner else {}),
                         progress=lambda m: console.print(f"serve: {m}", markup=False, highlight=False))
    if runner is not None:  # the global suffix tree deployed with the champion (never refuses to start)
        install_suffix_corpus(engine, champ)
    _install_class_drafts(engine, classes)
    sv = p.serve_resolved()
    console.print(serving_line(engine, sv.served_model_name), markup=False, highlight=False, soft_wrap=True)
    live = None
    try:
        app = build_app(engine, tok, sv, model=sv.served_model_name, drafts_dir=ws.drafts,
                        admin_token=os.environ.get(ADMIN_TOKEN_ENV), api_key=key,
                        load_version=registry_loader(target.target_id, ws), text_capture=text_capture,
                        watch_dir=champ, watch_s=sv.watch_champion_s, watch_classes_dir=classes,
                        rollback=registry_rollback(p, target.target_id, ws, follower))
        live = replica_reporter(p, engine, target.target_id, app.state.metrics, *_capture_state(
            writer, text_capture, ws.snapshots, target.target_id, p.serve.replica_id))
        uvicorn.run(app, host=host, port=port)
    finally:
        for c in (writer, follower, live):
            if c is not None:
                c.close()


def _capture_state(writer, text, snapshots: Path, tid: str, replica_id: str):
    """(backlog(), last_seal()) of the embedded server's capture (`backends.live.replica_state`): a
    hidden-state writer's unsealed tokens and this replica's newest local seal; a text log's tokens
    not yet handed to an ingest; (None, None) without capture."""
    from ..capture.snapshots import last_sealed
    if writer is not None:
        return (lambda: writer.stats().unsealed_tokens), (lambda: last_sealed(snapshots, tid, replica_id))
    return (text.backlog_tokens if text is not None else None), None


def serving_line(engine, model: str) -> str:
    """The line `tidespec serve` prints before it listens: the model name clients send, the target
    (id, precision, device), the draft served (version, or none yet: the champion watcher installs
    one), the proposers and the window (k fixed, or the goodput policy's choice up to k)."""
    t, cfg = engine.target, engine.cfg
    draft = f"draft v{engine.draft_version}" if engine.draft_version else "no draft yet (target alone until one is " \
                                                                             "deployed)"
    window = (f"k chosen per step up to {cfg.num_draft_tokens} (goodput policy)" if engine.policy is not None
              else f"k = {cfg.num_draft_tokens}")
    names = "+".join(pr.name for pr in engine.proposers) or "none"
    return (f"serve: model {model!r}: target {t.target_id[:12]} ({t.precision} on {t.device}), {draft}; "
            f"proposers {names}, {window}")


def serve_preflight(root: Path, params: Path, *, backend: str = "embedded", sglang_url: str | None = None,
                    sglang_python: str | None = None, vllm_python: str | None = None, capture: bool = True,
                    publish: bool = True, max_queue: int | None = None, timeout_s: float | None = None,
                    max_tokens: int | None = None, api_key: str | None = None, env=None):
    """Everything `tidespec serve` checks before it loads a model or starts a server, with the
    command's own arguments: the params file, the flags against the backend and the params
    (`serve_launch.ServeLaunch`), and, for hidden-state capture with publishing, the publisher
    (`_serve_publisher`). Prints the notes. Returns (params with the flags applied, workspace,
    launch, publisher or None).
    Raises ValueError / typer.BadParameter naming the fix. `env`: the environment (default os.environ)."""
    from ..config import load_params
    from ..config.serve_launch import ServeLaunch
    p, ws = load_params(params), ws_of(root)
    launch = ServeLaunch.build(backend=backend, sglang_url=sglang_url, sglang_python=sglang_python,
                               vllm_python=vllm_python, capture=capture, publish=publish, max_queue=max_queue,
                               request_timeout_s=timeout_s, max_tokens=max_tokens, api_key=api_key)
    p = _with_flags(p, launch)
    if launch.launches:
        _engine_runs_here(launch)
    for note in launch.check(p, os.environ if env is None else env):
        console.print(f"serve: {note}", markup=False, highlight=False)
    hidden = launch.backend == "embedded" and capture and p.capture.mode == "hidden"
    if capture:  # said at every start: served traffic is stored, on disk and (published) in DVC
        console.print(f"serve: capture is on ({'hidden states' if hidden else 'request/response text'} of "
                      f"served requests, under {ws.data / 'capture'}); --no-capture turns it off",
                      markup=False, highlight=False, soft_wrap=True)
    return p, ws, launch, _serve_publisher(p, ws, env) if hidden and publish else None

def _engine_runs_here(launch) -> None:
    """Refuses, before any note, an engine server this command cannot start here (its adapter's
    `unavailable_reason`: no environment, no CUDA for SGLang, no AVX2 for vLLM's CPU build, no
    `make llama-server` build). Raises VLLMUnavailable / SGLangUnavailable / LlamaCppUnavailable
    naming the fix."""
    if launch.backend == "llama-cpp":
        from ..backends import llama_cpp
        reason = llama_cpp.unavailable_reason()
        if reason:
            raise llama_cpp.LlamaCppUnavailable(reason)
        return
    if launch.backend == "vllm":
        from ..backends import vllm as engine
        python, refused = launch.vllm_python or engine.default_python(), engine.VLLMUnavailable
    else:
        from ..backends import sglang as engine
        python, refused = launch.sglang_python or engine.default_python(), engine.SGLangUnavailable
    reason = engine.unavailable_reason(python)
    if reason:
        raise refused(reason)


def _with_flags(p, launch):
    """The params with the embedded engine's flags (--max-queue, --timeout-s, --max-tokens) over
    `serve:`, validated as params.yaml is (e.g. serve.max_tokens < engine.max_seq_len); raises
    ValueError naming the flag."""
    from pydantic import ValidationError

    from ..config import Params
    from ..config.strict import one_line
    flags = {k: getattr(launch, k) for k in ("max_queue", "request_timeout_s", "max_tokens")
             if getattr(launch, k) is not None}
    if not flags:
        return p
    try:
        return Params.model_validate({**dict(p), "serve": p.serve.model_copy(update=flags)})
    except ValidationError as e:
        named = ", ".join(launch.labels[k] + f" {v:g}" for k, v in flags.items())
        raise ValueError(f"{named}: {one_line(e)}") from None


def _unpublished(pub, target_id: str) -> list:
    """The local snapshots a killed process sealed but never published (`Publisher.pending`), for the
    writer to publish at start; [] without a publisher."""
    if pub is None:
        return []
    from ..capture.snapshots import load_snapshot
    return [load_snapshot(s) for s in pub.pending(target_id)]


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

def _serve_frontdoor(p, ws, launch, host: str, port: int, api_key: str | None = None) -> None:
    """`tidespec serve --backend sglang|vllm|llama-cpp`: the OpenAI front door (`frontdoor.py`) before an
    engine server: one this command starts (vLLM, llama.cpp; SGLang without --sglang-url), with each
    champion the cycle deploys loaded into it (`backends.vllm.deployment`, `backends.sglang.deployment`;
    llama.cpp blue/green, `backends.llama_cpp.deployment`) and its
    live acceptance logged and acted on (`backends.live`); or the user's SGLang at `launch.sglang_url`,
    as it is. The champion comes from `champion_source` (data/drafts, or the registry followed).
    Capture there is text (a front door sees no hidden states). `api_key`: the key the front door
    checks (None: open); the engine server it starts listens on loopback without one."""
    import uvicorn

    from ..capture.text import TextCapture
    from ..models.hf_files import target_id
    from ..serve.frontdoor import build_frontdoor
    capture = launch.capture
    if p.train.class_drafts:  # one draft per engine server there: said, never silently dropped
        log.warning("train.class_drafts %s: the %s backend serves one EAGLE3 draft, the generalist, for every class; "
                    "the class drafts are served by the embedded engine (docs/serving.md, A draft per workload "
                    "class)", p.train.class_drafts, launch.backend)
    text = TextCapture(ws.text_capture_dir(target_id(p)), p.capture) if capture else None
    textlog = _text_log(text, target_id(p), p.capture.seal_min_tokens)
    timeout = launch.request_timeout_s or p.serve.request_timeout_s
    auth = {"api_key": api_key, "auth_health_metrics": p.serve.auth_health_metrics,
            "replica_id": p.serve.replica_id}  # the label on the front door's own /metrics series
    if not launch.launches:
        _note_unanswered(launch.sglang_url)
        uvicorn.run(build_frontdoor(launch.sglang_url, text, timeout, textlog=textlog, **auth), host=host, port=port)
        return
    champ, _, follower = champion_source(p, ws, target_id(p), classes=False)  # one draft: the generalist
    with _sigterm_raises():  # a SIGTERM while the engine server starts stops it too (its own process group)
        dep = (_start_vllm(p, ws, launch.vllm_python, host, champ) if launch.backend == "vllm"
               else _start_llama_cpp(p, ws, host, champ) if launch.backend == "llama-cpp"
               else _start_sglang(p, ws, launch.sglang_python, host, champ))
    from ..backends.llama_cpp import request_refusal
    refuse = request_refusal if launch.backend == "llama-cpp" else None  # what llama.cpp would fail or ignore
    app = build_frontdoor(dep.url, text, timeout, on_close=dep.close, textlog=textlog, **auth, refuse=refuse,
                          info=lambda: {"draft_version": dep.draft_version, "engine": launch.backend,
                                        "replica_id": p.serve.replica_id, "canary": p.serve.canary})
    dep.proxy = app.state.proxy
    from ..serve.admin import ChampionWatcher, DraftPin
    every, hold = p.serve.watch_champion_s, DraftPin()
    watcher = ChampionWatcher(champ, every, dep, dep.install, hold) if every > 0 else None
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    from ..backends.live import LiveReporter, replica_state, server_guard
    from ..steps.tuning import live_windows
    guard = server_guard(dep, registry_rollback(p, target_id(p), ws, follower), hold)
    live = (LiveReporter(dep, uri, target_id(p), p.serve.live_stats_s,
                         lambda per_pos, n: live_windows(p.deploy.sagemaker, per_pos, n), guard,
                         guard.source, p.serve.replica_id,
                         replica_state(dep.proxy.metrics.requests_served, textlog.backlog_tokens))
            if uri and p.serve.live_stats_s > 0 else None)
    try:
        uvicorn.run(app, host=host, port=port)
    finally:
        for c in (watcher, live, follower):
            if c:
                c.close()
        dep.close()

def _note_unanswered(url: str) -> None:
    """Says at start when the SGLang at --sglang-url does not answer `GET /health` with 200 (5 s at
    most; the front door starts anyway: the user's server may come up later)."""
    import httpx
    try:
        code = httpx.get(f"{url.rstrip('/')}/health", timeout=5).status_code
    except httpx.HTTPError as e:
        console.print(f"serve: --sglang-url {url} does not answer GET /health ({type(e).__name__}): requests fail "
                      "until it does", markup=False, highlight=False, soft_wrap=True)
        return
    if code != 200:
        console.print(f"serve: --sglang-url {url} answers GET /health with {code}: the front door's /health says "
                      "503 until it answers 200 (requests are forwarded meanwhile)", markup=False, highlight=False,
                      soft_wrap=True)


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM raises SystemExit(143) inside the block (the default action ends the process without
    running `finally` blocks, which left a starting vLLM or SGLang, in its own process group, running
    with no parent); the previous handler is restored after it (uvicorn then installs its own)."""
    def _exit(signum, frame):
        raise SystemExit(128 + signum)
    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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

def _start_vllm(p, ws, python: str | None, host: str, champion: Path | None = None):
    """Start vLLM on a loopback port (the front door is its only client) on the target (converted HF
    dir) with the served champion (if any) as its EAGLE3 draft, loaded in place at later deploys:
    k = engine.num_draft_tokens, max_model_len = engine.max_seq_len (None: the model's), max_num_seqs =
    engine.max_batch, --dtype = target.dtype (the engine knobs vLLM has no equivalent for were refused
    by `serve_preflight`). `champion`: the champion bundle it starts with (default data/drafts/champion)."""
    from ..adapters.process import loopback
    from ..backends.vllm import VLLMLaunch
    from ..backends.vllm.deployment import VLLMDeployment
    launch = VLLMLaunch.from_params(p, python=python, host=loopback(host),  # only the front door talks to vLLM
                                    served_model_name=p.serve_resolved().served_model_name)
    console.print(f"serve: starting vLLM ({launch.python}; log under {ws.state / 'vllm' / 'logs'}; ~30-60 s on CPU)",
                  markup=False)
    return VLLMDeployment(launch, ws.state / "vllm").start(_existing(champion or ws.champion))

def _start_llama_cpp(p, ws, host: str, champion: Path | None = None):
    """Start llama.cpp's llama-server (`make llama-server`) on a loopback port with the target GGUF as
    shipped and the served champion (if any) converted to an EAGLE-3 GGUF as its draft, swapped
    blue/green at later deploys (`LlamaCppLaunch.from_params`: k = engine.num_draft_tokens, slots =
    engine.max_batch). `champion`: as `_start_vllm`'s."""
    from ..adapters.process import loopback
    from ..backends.llama_cpp import LlamaCppLaunch
    from ..backends.llama_cpp.deployment import LlamaCppDeployment
    from ..models.hf_files import target_dir
    launch = LlamaCppLaunch.from_params(p, host=loopback(host), alias=p.serve_resolved().served_model_name)
    console.print(f"serve: starting llama-server ({launch.home}; log under {ws.state / 'llama-cpp' / 'logs'})",
                  markup=False)
    return LlamaCppDeployment(launch, ws.state / "llama-cpp", target_dir(p.target.source)).start(
        _existing(champion or ws.champion))

def _start_sglang(p, ws, python: str | None, host: str, champion: Path | None = None):
    """Start SGLang (its own environment's `python`) on a loopback port with the target (converted HF
    dir) and the served champion (if any) as its EAGLE3 draft, loaded in place at later deploys:
    engine.num_draft_tokens steps, engine.tree's topk and size, context length = engine.max_seq_len
    (None: the model's), max running requests = engine.max_batch, --dtype = target.dtype (float32
    with SGLang's triton attention backend: `SGLANG_FLOAT32_ARGS`). `champion`: as `_start_vllm`'s.
    Raises SGLangUnavailable naming the fix (no CUDA, no SGLang environment)."""
    from ..adapters.process import free_port, loopback
    from ..backends.sglang import SGLANG_FLOAT32_ARGS, SGLangLaunch, default_python
    from ..backends.sglang.deployment import SGLangDeployment
    from ..config import tree_num_draft_tokens
    from ..models.hf_files import target_dir
    e, sv = p.engine, p.serve_resolved()
    topk = e.tree.eagle_topk
    host = loopback(host)  # only the front door and the swap script talk to it
    launch = SGLangLaunch(str(target_dir(p.target.source)), python=python or default_python(), host=host,
                          port=free_port(host), num_steps=e.num_draft_tokens, eagle_topk=topk,
                          num_draft_tokens=tree_num_draft_tokens(e.num_draft_tokens, topk,
                                                                 e.tree.num_draft_tokens if topk > 1 else None),
                          served_model_name=sv.served_model_name, context_length=e.max_seq_len,
                          max_running_requests=e.max_batch, dtype=p.target.dtype,
                          extra_args=SGLANG_FLOAT32_ARGS if p.target.dtype == "float32" else ())
    console.print(f"serve: starting SGLang ({launch.python}; log under {ws.state / 'sglang' / 'logs'})", markup=False)
    return SGLangDeployment(launch, ws.state / "sglang").start(_existing(champion or ws.champion))

def _existing(path: Path) -> Path | None:
    return path if path.exists() else None


def _install_class_drafts(engine, root: Path) -> None:
    """The workload classes' own champions under `root` into the engine at start
    (`engine.build.install_class_drafts`)."""
    from ..engine.build import install_class_drafts
    for workload, v in install_class_drafts(engine, root).items():
        if v is not None:
            log.info("class %r served by its own draft %s", workload, v)
