"""The loop around an engine server `tidespec serve --backend` starts (`run_demo`): one TIDE cycle
on SmolLM2-135M and HumanEval, with no hand step between the requests and the new draft;
`demos.vllm` (`make demo-vllm`) and `demos.llama_cpp` (`make demo-llama-cpp`) run it.

Prefect and MLflow on 127.0.0.1 and a fresh workspace (`.tidespec/demo-<backend>/`); the static draft
becomes the first champion; `tidespec serve --backend <backend>` (the command a user runs) serves it;
HumanEval traffic through the front door is text-captured → tide-capture → tide-cycle → the serving
command swaps the engine server to the promoted draft; τ before and after as the engine server's own
counters report it, on holdout prompts never served. The steps in full: docs/design/bench.md.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml
from rich.console import Console
from rich.table import Table

from .. import assets
from ..adapters import orchestrate, registry, services, versioning
from ..adapters.process import free_port, poll_until
from ..assets import prompts
from ..config import load_params
from ..config.serve_launch import API_KEY_ENV
from ..engine.spec_counters import SpecDecodeCounters
from ..models.chat import prompt_ids
from ..models.load import get_target
from ..steps.bootstrap import bootstrap_static
from ..steps.cycle import step_deploy
from ..workspace import Workspace
from .progress import Reporter

console = Console(width=None if Console().is_terminal else 120)
N_HOLDOUT = 12  # holdout prompts measured before and after
CLIENTS = 4  # concurrent clients of the demo's traffic


@dataclass(frozen=True)
class ServedEngine:
    """The engine server the demo has `tidespec serve` start. backend: its `--backend` (also the
    demo's name: `.tidespec/demo-<backend>/`, `demo-<backend>.json`); label: its name in what the demo
    prints; serve_args: further `tidespec serve` flags; scrape: its spec-decode counters at a URL
    (the backend's `scrape`); swap: how the serving command puts a new draft in, as printed; unset:
    environment variables the demo's serve command must not see besides the front door's API key
    (a name, or a prefix ending in `_`); env: what it gets instead or besides."""

    backend: str
    label: str
    serve_args: tuple[str, ...]
    scrape: Callable[[str], SpecDecodeCounters | None]
    swap: str
    unset: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    def keeps(self, key: str) -> bool:
        """Whether the serve command gets environment variable `key`."""
        return not any(key == u or (u.endswith("_") and key.startswith(u)) for u in (API_KEY_ENV, *self.unset))


def seal_threshold(prompt_tokens: list[int]) -> int:
    """capture.seal_min_tokens for the demo: 90 % of the train traffic's prompt tokens. Completions
    add more, so the text log passes it once, before the traffic ends, whatever the completions'
    lengths; what follows it (≤ 10 % of the prompts + the completions, < the threshold while the
    completions stay under 80 % of the prompts) cannot pass it a second time."""
    return int(0.9 * sum(prompt_tokens))


def run_demo(engine: ServedEngine, root: Path, params_path: Path, results: Path | None = None) -> dict:
    """The demo (module docstring) around `engine`, which the caller checked can run here. Returns
    the summary, also written to `results`/demo-<backend>.json (default `root`/data/work/results,
    git-ignored). Raises RuntimeError when a step does not happen in time."""
    t0 = time.perf_counter()
    root = Path(root).resolve()
    base = load_params(params_path)
    ws = Workspace((root / ".tidespec" / f"demo-{engine.backend}").resolve())
    shutil.rmtree(ws.root, ignore_errors=True)
    project = orchestrate.project_root()
    ws.root.mkdir(parents=True)
    shutil.copy(project / "prefect.yaml", ws.root / "prefect.yaml")
    shutil.copytree(project / "flows", ws.root / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    with console.status("fetching assets; starting Prefect (server + worker) and MLflow on 127.0.0.1"):
        assets.fetch_all()
        svc = services.up(ws.state / "services")
    env = services.env_for(svc)
    os.environ.update(env)
    try:
        out = _loop(engine, ws, env, base)
    finally:  # the servers this demo started stop whatever happened (their logs flushed first)
        orchestrate.flush_logs()
        services.down(ws.state / "services")
    out["wall_s"] = time.perf_counter() - t0
    _report(engine, Path(results or root / "data" / "work" / "results"), out)
    return out


def _loop(engine: ServedEngine, ws: Workspace, env: dict, base) -> dict:
    """Steps 2-5 of the module docstring against the started services (`env`)."""
    api, uri = env["PREFECT_API_URL"], env["MLFLOW_TRACKING_URI"]
    target, tok = get_target(base)
    tid = target.target_id
    w = base.workload
    train, hold = prompts.split(prompts.load(w.prompts), w.holdout_fraction, w.seed)
    train, hold = train[: w.serve_prompts], hold[:N_HOLDOUT]
    raw = base.model_dump(mode="json")
    raw["capture"] |= {"mode": "text", "seal_min_tokens": seal_threshold([len(prompt_ids(tok, p.text)) for p in train])}
    raw["serve"] |= {"live_stats_s": 5.0}
    (ws.root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    params = load_params(ws.root / "params.yaml")
    subprocess.run(["git", "init", "-q", str(ws.root)], check=True)  # its own repo, not the user's checkout
    versioning.ensure_repo(ws.root, str(ws.state / "dvc-remote"), machine_local=True)
    with Reporter(console) as report:  # keyed by the unmodified params
        static = bootstrap_static(base, target, tok, assets.cache_dir(), report, say=console.print)
    _, v1 = registry.log_candidate(uri, tid, static, params.model_dump(mode="json"), {}, {"role": "static-bootstrap"},
                                   run_name="static-bootstrap")
    registry.promote(uri, tid, v1, f"demo-{engine.backend}: the static draft is the first champion",
                     allow_unevaluated=True)
    step_deploy(ws, uri, tid, params)
    with console.status("prefect deploy (tide-capture, tide-cycle, tide-train)"):
        orchestrate.deploy(ws.root, api)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = ws.state / "serve.log"
    cmd = [sys.executable, "-m", "tidespec.cli", "serve", "--backend", engine.backend, *engine.serve_args,
           "--root", str(ws.root), "--params", str(ws.root / "params.yaml"), "--port", str(port)]
    console.print(f"$ tidespec serve --backend {engine.backend} --root {ws.root} --port {port}   (log: {log})",
                  markup=False)
    keyless = {k: v for k, v in (os.environ | env).items() if engine.keeps(k)} | engine.env
    with open(log, "w") as lf:  # its server on 127.0.0.1 is the demo's own: no API key, whatever the shell exports
        proc = subprocess.Popen(cmd, cwd=ws.root, env=keyless, stdout=lf, stderr=subprocess.STDOUT)
    try:
        return _traffic_and_cycle(engine, ws, params, tid, uri, api, url, proc, log, train, hold, tok, v1)
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def _traffic_and_cycle(engine, ws, params, tid, uri, api, url, proc, log, train, hold, tok, v1) -> dict:
    """Steps 4-5: traffic, the cycle the events start, the swap, τ before/after from the engine server's counters."""
    model = params.serve_resolved().served_model_name
    h = _wait(lambda: _health(url), 600, f"{engine.label} behind the front door to be healthy", proc, log)
    console.print(f"serving: {engine.label} with champion v{h['draft_version']} as its EAGLE3 draft "
                  f"(k = {params.engine.num_draft_tokens}); seal at {params.capture.seal_min_tokens} captured tokens")
    with console.status(f"traffic: {len(train)} HumanEval train prompts, {CLIENTS} clients, captured"):
        served = _send(url, model, train, params.engine.max_new_tokens, store=None)
    console.print(f"traffic: {len(served)} exchanges, {sum(u['total_tokens'] for u in served)} tokens")
    snaps = ws.snapshots / tid
    with console.status("text log → tidespec.capture.text → tide-capture: rehydrate, seal, dvc push, event"):
        dvc = _wait(lambda: sorted(snaps.glob("*.dvc")) if snaps.is_dir() else [], 900, "a published snapshot",
                    proc, log)[0]
        rev = _wait(lambda: _rev(ws.root, snaps / dvc.stem), 120, "the snapshot's dvc rev", proc, log)
    console.print(f"snapshot {dvc.stem} published (dvc rev {rev}) → tidespec.capture.threshold → tide-cycle")
    with console.status(f"holdout on v{v1} ({len(hold)} prompts, store: false): {engine.label}'s counters"):
        before = _measure(engine, url, model, hold, params.engine.max_new_tokens)
    with console.status("tide_cycle run on the worker: curate → train → evaluate → register → deploy") as st:
        run = orchestrate.wait_for_run(api, orchestrate.CYCLE_DEPLOYMENT, {"snapshot_rev": rev}, 3600,
                                       on_poll=lambda r: st.update(f"tide_cycle run {r.name}: {r.state_name}")
                                       if r else None)
    if not run.state.is_completed():
        raise RuntimeError(f"tide_cycle run {run.name} ended {run.state_name}: {run.state.message}; "
                           f"{engine.label} keeps serving v{v1}; see {api[:-4]}/runs/flow-run/{run.id}")
    champ = registry.champion(uri, tid)
    promoted = champ.version != v1
    if promoted:
        with console.status(f"the serving command swaps {engine.label} to v{champ.version} ({engine.swap})"):
            _wait(lambda: (x := _health(url)) and x["draft_version"] == champ.version, 900,
                  f"{engine.label} to serve v{champ.version}", proc, log)
    with console.status(f"holdout on v{champ.version} ({len(hold)} prompts, store: false): {engine.label}'s counters"):
        after = _measure(engine, url, model, hold, params.engine.max_new_tokens)
    rep = json.loads(ws.eval_report.read_text()) if ws.eval_report.exists() else None
    same = before.pop("texts") == after.pop("texts")  # greedy: the draft never changes the output
    return {"same_outputs": same, "versions": [v1, champ.version], "promoted": promoted, "snapshot_rev": rev,
            "decision": champ.tags.get("decision_reason", "") if promoted else "not promoted",
            "cycle_s": run.total_run_time.total_seconds(), "k": params.engine.num_draft_tokens,
            "holdout_prompts": len(hold), "before": before, "after": after,
            "replay": {"champion": (rep or {}).get("champion"), "candidate": (rep or {}).get("candidate")},
            "workspace": str(ws.root)}


def _rev(repo: Path, snapshot: Path) -> str | None:
    """A published snapshot's DVC rev, None while its .dvc file is still being written."""
    try:
        return versioning.snapshot_rev(repo, snapshot)
    except versioning.VersioningError:
        return None


def _health(url: str) -> dict | None:
    try:
        r = httpx.get(f"{url}/health", timeout=5)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def _wait(fn, timeout_s: float, what: str, proc, log: Path):
    """Poll `fn` until truthy; RuntimeError (with the serve log's tail) on timeout or if serve exits."""
    return poll_until(fn, timeout_s, what, proc, log, poll_s=1.0, error=RuntimeError)


def _send(url: str, model: str, batch, max_tokens: int, store: bool | None) -> list[dict]:
    """Chat completions for `batch` (prompts.Prompt) from CLIENTS threads, greedy; returns each one's
    usage with the answer's text under "text"."""
    def one(p):
        body = {"model": model, "messages": [{"role": "user", "content": p.text}], "max_tokens": max_tokens,
                "temperature": 0} | ({} if store is None else {"store": store})
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        if r.status_code != 200:
            raise RuntimeError(f"POST /v1/chat/completions: {r.status_code} {r.text[:300]}")
        out = r.json()
        return out["usage"] | {"text": out["choices"][0]["message"]["content"]}
    with ThreadPoolExecutor(CLIENTS) as ex:
        return list(ex.map(one, batch))


def _measure(engine: ServedEngine, url: str, model: str, batch, max_tokens: int) -> dict:
    """The engine server's spec-decode counters over `batch` (sent with store: false), as a difference
    of scrapes."""
    c0 = engine.scrape(url)
    usage = _send(url, model, batch, max_tokens, store=False)
    d = engine.scrape(url) - c0
    return {"tau": d.acceptance_length, "num_drafts": d.num_drafts, "num_draft_tokens": d.num_draft_tokens,
            "num_accepted_tokens": d.num_accepted_tokens, "accepted_per_pos": list(d.accepted_per_pos),
            "completion_tokens": sum(u["completion_tokens"] for u in usage), "texts": [u["text"] for u in usage]}


def _report(engine: ServedEngine, results: Path, out: dict) -> None:
    b, a = out["before"], out["after"]
    t = Table(title=f"HumanEval holdout, {out['holdout_prompts']} prompts, greedy, k={out['k']}: "
                    f"{engine.label}'s own counters")
    for c in ("draft", f"τ ({engine.label})", "drafts", "draft tokens", "accepted", "per position",
              "τ in the cycle's evaluate (its holdout, tidespec replay)"):
        t.add_column(c)
    rp = out["replay"]
    for name, v, m in ((f"v{out['versions'][0]} static", b, rp["champion"]),
                       (f"v{out['versions'][1]} {'adapted' if out['promoted'] else 'static (not promoted)'}", a,
                        rp["candidate"] if out["promoted"] else rp["champion"])):
        t.add_row(name, f"{v['tau']:.3f}" if v["tau"] else "unknown", str(v["num_drafts"]), str(v["num_draft_tokens"]),
                  str(v["num_accepted_tokens"]), " / ".join(map(str, v["accepted_per_pos"])),
                  f"{m['acceptance_length']:.2f}" if m else "-")
    console.print(t)
    console.print(f"outputs of the {out['holdout_prompts']} holdout prompts identical before and after the swap: "
                  f"{'yes' if out['same_outputs'] else 'NO'}", markup=False)
    console.print(f"cycle {out['cycle_s']:.0f} s; promoted={out['promoted']} ({out['decision']}); "
                  f"demo wall {out['wall_s'] / 60:.1f} min; workspace {out['workspace']}", markup=False)
    results.mkdir(parents=True, exist_ok=True)
    name = results / f"demo-{engine.backend}.json"
    name.write_text(json.dumps(out, indent=2) + "\n")
    console.print(f"results: {name}")
