"""`tidespec bench ...`: the benchmark commands (typer sub-app of `tidespec`). Results go to
bench/results/*.json + a markdown table; each command's module in this package does the work and is
imported when the command runs (as in `tidespec.cli`: `--help` stays fast)."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import typer
from rich.console import Console

from ..assets.prompts import STRUCTURED
from ..workspace import DRAFT_FILES, Workspace, engine_dir
from .scripts import SCRIPTS, register_script

bench_app = typer.Typer(help="Benchmarks; results to bench/results/*.json + a markdown table.")
console = Console()
PARAMS = typer.Option(Path("params.yaml"), "--params", help="params.yaml")
ROOT = typer.Option(Path("."), "--root", help="workspace root (data/ lives here)")
PROMPTS_FILE_HELP = ('your prompts instead of the built-in sets: JSONL, {"prompt": ..., "workload": "code"|"chat"|'
                     '"math", "id": ...} a line; --prompts caps each workload\'s')


@bench_app.command("train")
def bench_train(
    params: Path = PARAMS,
    max_new_tokens: int = typer.Option(256, min=8, help="generated tokens per snapshot request"),
    train_prompts: int = typer.Option(0, min=0, help="HumanEval train prompts served (0: all)"),
    holdout_prompts: int = typer.Option(0, min=0, help="holdout prompts (0: all)"),
    fractions: str = typer.Option(
        "1.0", help="comma-separated data fractions, e.g. 0.25,0.5,1.0 ('' with --shift: reuse the last 100% draft)"
    ),
    epochs: int = typer.Option(None, min=1, help="override train.epochs"),
    init: Path = typer.Option(None, help="warm start from this draft dir (default: from scratch)"),
    threads: int = typer.Option(None, min=1, help="torch CPU threads (default: all cores)"),
    root: Path = typer.Option(None, help="snapshot/work dir (default: <cache>/bench/code-<target>-<tokens>)"),
    shift: str = typer.Option("gsm-en", help="second workload for the forgetting/replay check ('' = skip)"),
    shift_prompts: int = typer.Option(48, min=2, help="prompts of the shifted workload (30% held out)"),
    out: Path = typer.Option(Path("bench/results")),
):
    """EAGLE3 training on a fixed code snapshot: τ at k on the holdout, tokens/s, time per cycle."""
    from .. import assets
    from ..config import load_params
    from ..models.load import get_target
    from . import train as bench
    p = load_params(params)
    try:
        fr = tuple(float(x) for x in fractions.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"--fractions {fractions!r}: comma-separated numbers in (0, 1]") from None
    if not (fr or shift) or not all(0 < f <= 1 for f in fr):
        raise typer.BadParameter(f"--fractions {fractions!r}: each must be in (0, 1]")
    if init is not None and not all((engine_dir(init) / f).exists() for f in DRAFT_FILES):
        raise typer.BadParameter(f"--init {init}: not a draft dir (needs config.json + model.safetensors)")
    if p.train.backend != "embedded":
        raise typer.BadParameter("bench train measures the embedded trainer; set train.backend: embedded "
                                 "(the SpecForge backend runs in its own environment on a GPU)")
    if shift:
        from ..assets import prompts as prompt_sets
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
        from ..assets import prompts as prompt_sets
        from ..models.chat import prompt_ids
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
                phases: str = typer.Option("", help="comma-separated phases in order (chat, code, math-en, "
                                                    "math-kj, structured; default: the mode's); results are named "
                                                    "after them"),
                traffic_prompts: int = typer.Option(None, min=2, help="traffic prompts served per phase (default: "
                                                    "the mode's, 24 / quick 12); half of them trigger the cycle"),
                out: Path = typer.Option(Path("bench/results")),
                work: Path = typer.Option(Path(".tidespec/bench-shift"), help="scratch workspace (wiped)")):
    """The workload-shift experiment: chat → code → math EN → math KO/JA at concurrency 1/4/8, no-spec vs
    static vs adapting draft with automatic cycles; writes bench/results/shift-<date>.{json,md,png}."""
    from ..config import load_params
    from . import shift
    cfg = shift.ShiftConfig.quick() if quick else shift.ShiftConfig()
    if phases:
        cfg = cfg.with_phases([p.strip() for p in phases.split(",") if p.strip()])
    if traffic_prompts:
        cfg = replace(cfg, traffic_prompts=traffic_prompts, name=f"{cfg.name}-t{traffic_prompts}")
    rep = shift.run(load_params(params), out, work.resolve(), cfg, progress=console.print)
    stem = rep["stem"]
    console.print((out / f"{stem}.md").read_text(), markup=False, soft_wrap=True)  # markdown, not rich markup
    console.print(f"wrote {out / stem}.json/.md/-*.png in {rep['wall_s'] / 60:.1f} min")


@bench_app.command("adapt")
def bench_adapt(params: Path = PARAMS, quick: bool = typer.Option(False, "--quick", help="3 cycles + switch and "
                                                                                       "back, concurrency 1 and 8, "
                                                                                       "fewer prompts (≈15 min)"),
                workload: str = typer.Option("code", help="the workload adapted to (a bench shift phase)"),
                switch_to: str = typer.Option("chat", help="the workload switched to, then back ('' = no switch)"),
                cycles: int = typer.Option(None, min=1, help="cycles on the workload before the switch (default: "
                                           "6, quick 3)"),
                traffic_concurrency: int = typer.Option(8, min=1, help="requests served at once while capturing "
                                                        "(TIDE runs each level as its own experiment)"),
                traffic_prompts: int = typer.Option(None, min=1, help="fresh prompts per cycle (default 15, quick 8)"),
                passes: int = typer.Option(None, min=1, help="measurements per point, arms interleaved; tokens/s "
                                           "is their median (default 2; 3 adds ≈ 25 min)"),
                static: Path = typer.Option(None, help="the first champion and the static arm: this draft dir "
                                            "(e.g. `bench static-general`'s; default: make demo's bootstrap static)"),
                out: Path = typer.Option(Path("bench/results")),
                work: Path = typer.Option(Path(".tidespec/bench-adapt"), help="scratch workspace (wiped)")):
    """Self-improvement over time: ≥ 6 threshold-triggered cycles on one workload with fresh traffic,
    held-out tokens/s and τ after each (no speculation, static, the champion at fixed k, the champion
    as serve runs it) at concurrency 1/4/8, then a switch and back; bench/results/adapt-<date>.*"""
    from ..config import load_params
    from . import adapt
    from .adapt import static_label
    cfg = adapt.AdaptConfig.quick() if quick else adapt.AdaptConfig()
    upd = {"workload": workload, "switch_to": switch_to, "traffic_concurrency": traffic_concurrency}
    upd |= {k: v for k, v in (("cycles", cycles), ("traffic_prompts", traffic_prompts), ("passes", passes))
            if v is not None}
    upd |= {"static": str(static)} if static else {}
    name = cfg.name + (f"-{workload}" if workload != "code" else "") + (
        f"-tc{traffic_concurrency}" if traffic_concurrency != 8 else "")
    name += f"-{static_label(static)}" if static else ""
    try:
        cfg = replace(cfg, **upd, name=name).validate()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    rep = adapt.run(load_params(params), out, work.resolve(), cfg, progress=console.print)
    stem = rep["stem"]
    console.print((out / f"{stem}.md").read_text(), markup=False, soft_wrap=True)
    console.print(f"wrote {out / stem}.json/.md/-*.png in {rep['wall_s'] / 60:.1f} min")


@bench_app.command("sequence")
def bench_sequence(params: Path = PARAMS,
                   quick: bool = typer.Option(False, "--quick", help="code → chat → code, concurrency 1 and 8, one "
                                              "pass (about half the full run)"),
                   sequence: str = typer.Option(None, help="comma-separated bench shift phases (default "
                                                "code,chat,math-en,structured,code)"),
                   traffic_prompts: int = typer.Option(None, min=1, help="fresh prompts per cycle (default 12, "
                                                       "quick 8)"),
                   passes: int = typer.Option(None, min=1, help="throughput passes, arms interleaved (default 2)"),
                   static: Path = typer.Option(None, help="the first champion and the static arm: this draft dir or "
                                               "bundle (e.g. `bench static-general`'s); default: the bootstrap static "
                                               "starts, the static arm is one trained on the classes arm's tokens"),
                   class_drafts: str = typer.Option("listed", help="the classes arm's train.class_drafts: listed "
                                                    "(every class of the sequence) or auto"),
                   out: Path = typer.Option(Path("bench/results")),
                   resume: bool = typer.Option(True, help="keep the arms an interrupted run of the same config "
                                               "finished (out/<name>.partial.json, their workspaces in --work)"),
                   work: Path = typer.Option(Path(".tidespec/bench-sequence"), help="scratch workspaces (wiped)")):
    """Drafts per workload class + replay against one draft without replay over a traffic-shift
    sequence: τ per class after each cycle, forgetting, then tokens/s at concurrency 1/4/8 against a
    static draft (given, or trained on as many tokens), the in-domain statics (each class's first
    champion, frozen) and no speculation; bench/results/sequence-<date>.*"""
    from ..config import load_params
    from . import sequence as seq
    cfg = seq.SequenceConfig.quick() if quick else seq.SequenceConfig()
    upd = {k: v for k, v in (("traffic_prompts", traffic_prompts), ("passes", passes)) if v is not None}
    if static:
        from .adapt import static_label
        upd |= {"static": str(static.resolve()), "name": f"{cfg.name}-{static_label(static)}"}
    if sequence:
        upd["sequence"] = tuple(x.strip() for x in sequence.split(",") if x.strip())
    if class_drafts != "listed":
        upd |= {"class_drafts": class_drafts, "name": f"{upd.get('name', cfg.name)}-{class_drafts}"}
    try:
        cfg = replace(cfg, **upd).validate()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    rep = seq.run(load_params(params), out, work.resolve(), cfg, progress=console.print, resume=resume)
    console.print((out / f"{rep['stem']}.md").read_text(), markup=False, soft_wrap=True)
    console.print(f"wrote {out / rep['stem']}.json/.md in {rep['wall_s'] / 60:.1f} min")


@bench_app.command("serve")
def bench_serve(root: Path = ROOT, params: Path = PARAMS, clients: int = typer.Option(64, min=1),
                duration_s: float = typer.Option(60.0, min=1), prompts: int = typer.Option(16, min=1),
                max_tokens: int = typer.Option(32, min=1), out: Path = typer.Option(Path("bench/results"))):
    """Load test of the HTTP server on the real target with the served champion: CLIENTS concurrent
    greedy clients on 127.0.0.1 for DURATION_S, a draft hot-swap half-way (to a copy of the champion
    under another version name), outputs checked against target-only. Writes OUT/serve.json."""
    import shutil

    from .. import assets
    from ..assets import prompts as prompt_sets
    from ..config import ServeParams, load_params
    from ..engine.build import make_engine
    from ..models.chat import prompt_ids
    from ..models.load import get_target, runner_for
    from ..serve.server import build_app
    from ..workspace import VERSION_FILE, served
    from .serve import load, serve_in_thread
    p, ws = load_params(params), Workspace(root.resolve())
    assets.fetch_all()
    target, tok = get_target(p)
    runner = runner_for(ws.champion, target)
    if runner is None:
        raise FileNotFoundError(f"no served champion at {ws.champion}: run `make demo` first")
    swap_dir = ws.champion.with_name("bench-swap")
    shutil.rmtree(swap_dir, ignore_errors=True)
    shutil.copytree(ws.champion, swap_dir)
    (swap_dir / VERSION_FILE).unlink(missing_ok=True)
    held_out = prompt_sets.split(prompt_sets.load(p.workload.prompts), p.workload.holdout_fraction, p.workload.seed)[1]
    ids = [prompt_ids(tok, x.text) for x in held_out[:prompts]]
    engine = make_engine(p.engine, target, runner, **served(ws.champion))
    with console.status(f"target-only reference outputs for {len(ids)} prompts"):
        reference = {i: engine.generate(x, max_tokens, speculative=False).tokens for i, x in enumerate(ids)}
    srv = serve_in_thread(build_app(engine, tok, ServeParams(max_queue=clients, max_tokens=max_tokens),
                                    drafts_dir=swap_dir.parent, admin_token="bench"))
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
                 workload: list[str] = typer.Option(["code", "chat", "math"], help="code, chat and/or math"),
                 prompts_file: Path = typer.Option(None, exists=True, dir_okay=False, help=PROMPTS_FILE_HELP),
                 concurrency: list[int] = typer.Option([1, 4, 8, 16], help="closed-loop clients (repeat); "
                                                       "levels above 1 run the tidespec methods only"),
                 passes: int = typer.Option(3, min=1, help="interleaved passes (paired ratios, their spread)"),
                 method: list[str] = typer.Option([], help="only these rows (repeat; default: all); "
                                                  "tidespec_no_spec, the ratios' reference, is always run"),
                 profile: bool = typer.Option(True, help="a torch.profiler table of one request"),
                 vllm_python: str = typer.Option(None, help="vLLM's interpreter for the vllm_* rows (default: "
                                                 "`make vllm`'s .venv-vllm when it runs here; 'none': no vLLM rows)"),
                 precision: list[str] = typer.Option(["int8", "int4"], help="the target at these precisions too "
                                                     "(repeat; fp32, bf16, int8, int4): rows tidespec_no_spec_<p> and "
                                                     "tidespec_hybrid_adaptive_<p>; params' own is the reference"),
                 llama_cpp: bool = typer.Option(True, help="llama.cpp rows (llama-cpp-python, `make llama-cpp`); "
                                                "skipped with the reason where it is not installed"),
                 out: Path = typer.Option(Path("bench/results"))):
    """tidespec vs HF generate, HF prompt lookup, llama.cpp and a real vLLM (none, n-gram, EAGLE3
    static and adapted) on code, chat, math; capture on/off, suffix and hybrid, the target at other
    precisions, at concurrency 1/4/8/16, profile; ≥ 3 interleaved passes with paired ratios and their
    spread; JSON + markdown + a PNG of tokens/s by concurrency."""
    from .. import assets
    from ..config import load_params
    from ..models.hf_files import target_id
    from ..steps.bootstrap import static_draft_dir
    from . import engine as bench
    from .engine_report import WORKLOADS
    from .methods import llama_cpp_unavailable
    p = load_params(params)
    bad = set(workload) - set(WORKLOADS)
    if bad:
        raise ValueError(f"unknown workload(s) {sorted(bad)}; use {', '.join(WORKLOADS)}")
    if prompts_file is not None:  # the file's workloads, checked before any model is loaded
        workload = bench.file_workloads(prompts_file, workload)
    if any(c < 1 for c in concurrency):
        raise ValueError(f"--concurrency must be >= 1, got {sorted(concurrency)}")
    adapted = adapted or Workspace(root.resolve()).champion
    if not (engine_dir(Path(adapted)) / "model.safetensors").exists():  # checked before any model is loaded
        raise ValueError(f"adapted draft not found at {adapted}: run `make demo` first (it trains both), "
                         "or pass --adapted DIR")
    if static is None:
        static = static_draft_dir(p, target_id(p), assets.cache_dir())
    if not (engine_dir(Path(static)) / "model.safetensors").exists():
        raise ValueError(f"static draft not found at {static}: run `make demo` first (it trains both), "
                         "or pass --static DIR")
    vllm_python, vllm_skipped = _vllm_rows(vllm_python)
    llama_skipped = llama_cpp_unavailable() if llama_cpp else "--no-llama-cpp"
    if llama_cpp and llama_skipped:
        console.print(f"no llama_cpp_* rows: {llama_skipped}")
    specs = bench.select_methods(p, static, adapted, prompt_lookup, vllm_python, precision, llama_skipped, method)
    res = bench.run(p, out, static, adapted, prompts, max_new_tokens, threads, prompt_lookup, tuple(workload),
                    progress=console.print, passes=passes, methods=specs, profile=profile,
                    concurrency=tuple(concurrency), vllm_skipped=vllm_skipped, llama_cpp_skipped=llama_skipped,
                    prompts_file=prompts_file)
    console.print((out / "engine.md").read_text())
    console.print(f"wrote {out / 'engine.json'} and {out / 'engine.md'} in {res['setup']['wall_s']:.0f} s")


@bench_app.command("structured")
def bench_structured(root: Path = ROOT, params: Path = PARAMS,
                     static: Path = typer.Option(None, help="static draft dir (default: the cached bootstrap draft)"),
                     adapted: Path = typer.Option(None, help="adapted draft dir (default: <root>/data/drafts/champion; "
                                                  "rows without it when it is missing)"),
                     prompts: int = typer.Option(6, min=1, help="held-out prompts per set"),
                     max_new_tokens: int = typer.Option(160, min=1),
                     threads: int = typer.Option(None, min=1, help="torch CPU threads (default: all cores)"),
                     concurrency: list[int] = typer.Option([1, 8], help="closed-loop clients (repeat)"),
                     passes: int = typer.Option(3, min=1, help="interleaved passes (paired ratios, their spread)"),
                     prompt_set: list[str] = typer.Option(list(STRUCTURED), "--set",
                                                          help="structured prompt sets (repeat)"),
                     out: Path = typer.Option(Path("bench/results/structured"))):
    """Structured output and tool calls: constrained decoding without speculation vs grammar-forced
    tokens alone, suffix, static / adapted EAGLE3 and the hybrid, per structured set, at concurrency
    1 and a closed-loop sweep; every output checked valid and equal to the constrained reference."""
    from .. import assets
    from ..config import load_params
    from ..models.hf_files import target_id
    from ..steps.bootstrap import static_draft_dir
    from . import structured as bench
    p = load_params(params)
    bad = sorted(set(prompt_set) - set(STRUCTURED))
    if bad:
        raise ValueError(f"unknown structured set(s) {bad}; use {', '.join(STRUCTURED)}")
    if any(c < 1 for c in concurrency):
        raise ValueError(f"--concurrency must be >= 1, got {sorted(concurrency)}")
    adapted = adapted or Workspace(root.resolve()).champion
    if not (engine_dir(Path(adapted)) / "model.safetensors").exists():
        console.print(f"no adapted rows: no draft at {adapted} (pass --adapted DIR)")
        adapted = None
    static = static or static_draft_dir(p, target_id(p), assets.cache_dir())
    if not (engine_dir(Path(static)) / "model.safetensors").exists():
        raise ValueError(f"static draft not found at {static}: run `make demo` first, or pass --static DIR")
    res = bench.run(p, out, static, adapted, prompts, max_new_tokens, threads, passes, tuple(concurrency),
                    tuple(prompt_set), progress=console.print)
    console.print((out / "structured.md").read_text())
    console.print(f"wrote {out / 'structured.json'} and {out / 'structured.md'} in {res['setup']['wall_s']:.0f} s")


def _vllm_rows(python: str | None) -> tuple[str | None, str | None]:
    """(vLLM's interpreter or None, why there are no vLLM rows or None). Default: `make vllm`'s venv
    when it runs here, else no rows and the reason (printed and kept in the report); a --vllm-python
    given explicitly must work."""
    from ..backends import vllm
    if python == "none":
        return None, "--vllm-python none"
    reason = vllm.unavailable_reason(python or vllm.default_python())
    if reason and python:
        raise ValueError(f"--vllm-python {python}: {reason}")
    if reason:
        console.print(f"no vllm_* rows: {reason}")
        return None, reason
    return python or vllm.default_python(), None


@bench_app.command("classes")
def bench_classes(params: Path = PARAMS, sharegpt: int = typer.Option(2000, min=0, help="ShareGPT prompts to spread"),
                  out: Path = typer.Option(Path("bench/results"))):
    """Which request signal separates code, math and chat on the shipped sets (content rules vs
    clustering): the workload classes served requests get without a `workload` field."""
    from .. import assets
    from ..config import load_params
    from ..models.load import get_target
    from . import classes
    assets.fetch_all()
    _, tok = get_target(load_params(params))
    classes.run(tok, out, sharegpt)
    console.print((out / "classes.md").read_text())


@bench_app.command("capture")
def bench_capture(params: Path = PARAMS, prompts: int = typer.Option(8, min=1),
                  max_new_tokens: int = typer.Option(64, min=1), rounds: int = typer.Option(3, min=1),
                  out: Path = typer.Option(Path("bench/results"))):
    """Capture cost: ITL and tokens/s with capture off / raw / zstd / hung disk, bytes per token."""
    from ..config import load_params
    from . import capture as bench
    rep = bench.run(load_params(params), out, prompts, max_new_tokens, rounds, progress=console.print)
    console.print((out / "capture.md").read_text())
    console.print(f"wrote {out / 'capture.json'} and {out / 'capture.md'} in {rep['setup']['wall_s']:.0f} s")


@bench_app.command("scaling")
def bench_scaling(params: Path = PARAMS,
                  tokens: int = typer.Option(512, min=16, help="tokens in the prefilled sequence"),
                  rounds: int = typer.Option(3, min=1), out: Path = typer.Option(Path("bench/results"))):
    """Capture at real widths (SmolLM2, synthetic H = 2048 / 4096): bytes per token at rest, capture CPU
    against prefill."""
    from ..config import load_params
    from . import scaling
    scaling.run(load_params(params), out, tokens, rounds, progress=console.print)
    console.print((out / "scaling.md").read_text())


@bench_app.command("train-scaling")
def bench_train_scaling(params: Path = PARAMS,
                        tokens: int = typer.Option(16384, min=256, help="tokens of the throughput snapshot"),
                        seq_len: int = typer.Option(256, min=16), passes: int = typer.Option(3, min=1),
                        buffer_mb: float = typer.Option(64.0, min=1, help="train.buffer_mb of the memory arms"),
                        batch_tokens: int | None = typer.Option(None, min=8, help="train.batch_tokens (default: "
                                                                "params.yaml's)"),
                        memory: bool = typer.Option(True, help="also the memory arms (--no-memory: ranks only)"),
                        work: Path = typer.Option(Path(".cache/tidespec/bench-train-scaling")),
                        out: Path = typer.Option(Path("bench/results"))):
    """The train step at 1 and 2 ranks (tokens/s, paired ratios), and peak RSS against snapshot size
    (streamed vs held whole), on synthetic snapshots at the target's width."""
    from . import train_scaling
    train_scaling.run(params, out, tokens, seq_len, passes, buffer_mb, work, progress=console.print,
                      batch_tokens=batch_tokens, memory=memory)
    stem = "train_scaling" + (f"-b{batch_tokens}" if batch_tokens else "")
    console.print((out / f"{stem}.md").read_text())


@bench_app.command("online")
def bench_online(target: str = typer.Option("smollm2", help="smollm2 (params.yaml's target) or a synthetic width: "
                                             "h2048, llama8b-width"),
                 params: Path = PARAMS, tokens: int = typer.Option(4096, min=64),
                 seq_len: int = typer.Option(256, min=16),
                 passes: int = typer.Option(3, min=1), epochs: int = typer.Option(2, min=1),
                 buffer_mb: float = typer.Option(40.0, min=1, help="train.buffer_mb: below the set, so each epoch "
                                                 "reads its records again"),
                 device: str = typer.Option("cpu", help="where the target and the draft run: cpu, cuda[:N], auto"),
                 peak_tflops: float = typer.Option(790.0, min=1, help="the device's measured dense bf16 peak, "
                                                   "for the MFU column (H200: 790)"),
                 draft_vocab_size: int = typer.Option(4096, min=2,
                                                     help="the draft's vocabulary (capped at the target's)"),
                 batch_tokens: int = typer.Option(1024, min=8, help="train.batch_tokens (padded tokens per step)"),
                 work: Path = typer.Option(Path(".cache/tidespec/bench-online")),
                 out: Path = typer.Option(Path("bench/results"))):
    """Online rehydration (tokens at rest, hidden states rebuilt by the target while training) against
    hidden states read from disk: records/s, the train step's time with and without the producer thread,
    the trainer's tokens/s (and MFU on a GPU), bytes per token at rest."""
    from . import online
    try:
        res = online.run(target, params, out, work, tokens, seq_len, passes, epochs, buffer_mb,
                         progress=console.print, device=device, peak_tflops=peak_tflops,
                         draft_vocab=draft_vocab_size, batch_tokens=batch_tokens)
    except (ValueError, KeyError) as e:
        raise typer.BadParameter(str(e)) from e
    console.print((out / f"{res['stem']}.md").read_text())


for _name, (_module, _doc) in SCRIPTS.items():  # the experiment scripts (`bench.scripts`)
    register_script(bench_app, _name, _module, _doc)
