"""`tidespec bench train`: EAGLE3 training on a fixed code snapshot, measured where it counts.

1. snapshot (built once, cached): the target serves the HumanEval train split greedily with capture
   on (continuous batching), sealed as a snapshot; the holdout split (disjoint problems) is
   captured the same way into a separate holdout snapshot, with its target-only outputs;
2. per data fraction: curate → train from scratch (or warm start) → evaluate, timed as one cycle;
   after every epoch the holdout's teacher-forced accuracy per TTT step (unconditional) and the
   simulated τ from the conditional per-position acceptance (`trainer.evaluate_holdout`; learning curve);
3. evaluate: the holdout prompts replayed greedily with speculative decoding at k =
   engine.num_draft_tokens: τ, per-position acceptance, and outputs == the target-only outputs.
Output: `<out>/train.json` + `<out>/train.md`.
"""
from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..assets import prompts
from ..capture.curate import load_records
from ..capture.snapshots import list_snapshots, seal
from ..capture.store import iter_records
from ..capture.writer import CaptureWriter
from ..config import CaptureParams, EngineParams, Params
from ..engine.build import make_engine
from ..engine.speculative import Request
from ..engine.stats import SpecDecodingStats
from ..models.chat import prompt_ids
from ..models.eagle3 import load_checkpoint
from ..models.runner import DraftRunner
from ..models.target import Target
from ..steps.cycle import step_curate
from ..train.examples import prepare
from ..train.holdout import evaluate_holdout, holdout_accuracy
from ..train.trainer import train_draft
from ..workspace import Workspace


def humaneval_prompts(tok, params: Params) -> tuple[list[tuple[str, list[int]]], list[tuple[str, list[int]]]]:
    """(train, holdout) HumanEval prompts as (id, chat-templated ids), split as the demo splits them."""
    w = params.workload
    tr, ho = prompts.split(prompts.load("humaneval"), w.holdout_fraction, w.seed)
    return [(p.id, prompt_ids(tok, p.text)) for p in tr], [(p.id, prompt_ids(tok, p.text)) for p in ho]


def serve_and_capture(target: Target, prompts: list[tuple[str, list[int]]], max_new_tokens: int, capture_dir: Path,
                      workload: str, max_batch: int = 8, progress: Callable[[int], None] | None = None,
                      draft: DraftRunner | None = None, k: int = 0) -> dict:
    """Greedy generation of every prompt (continuous batching), captured to `capture_dir`: target-only,
    or EAGLE-3 chains of `k` from `draft` (the records then say where it was rejected). Returns
    {"outputs": {id: generated token ids}, "tokens_per_s", "seconds", "acceptance_length" (τ; 1.0
    target-only)}."""
    w = CaptureWriter(capture_dir, target.target_id, CaptureParams(shard_max_records=16))
    L = max(len(p) for _, p in prompts) + max_new_tokens + k + 2
    eng = make_engine(EngineParams().fixed(num_draft_tokens=max(k, 1), max_seq_len=L, max_batch=max_batch),
                      target, draft, capture=w)
    futs = {pid: eng.submit(Request(ids, max_new_tokens, speculative=draft is not None, k=k or None, capture=True,
                                    request_id=pid, workload=workload, prompt_id=pid))
            for pid, ids in prompts}  # the engine captures
    t0, outs, done, stats = time.perf_counter(), {}, 0, SpecDecodingStats(k)
    while eng.num_unfinished:
        eng.step()
        for pid, f in futs.items():
            if pid not in outs and f.done():
                g = f.result()
                outs[pid], stats = g.tokens, stats.merge(g.stats)
                done += 1
                if progress:
                    progress(done)
    w.close()
    secs = time.perf_counter() - t0
    return {"outputs": outs, "tokens_per_s": sum(map(len, outs.values())) / secs, "seconds": secs,
            "acceptance_length": stats.acceptance_length}


def build_snapshot(root: Path, target: Target, train_p, hold_p, max_new_tokens: int, max_batch: int = 8,
                   progress: Callable[[str], None] = print) -> dict:
    """Serve and seal the fixed snapshot under `root` (reused when `root/snapshot.json` exists):
    train prompts → `root/data/snapshots/<target>/`, holdout → `root/holdout/<target>/` plus
    `root/holdout.jsonl` (ids, prompt ids, target-only reference outputs). Returns the metadata
    (records, tokens, serve tokens/s and seconds per part)."""
    meta = root / "snapshot.json"
    if meta.exists():
        return json.loads(meta.read_text())
    ws = Workspace(root)
    info = {"target_id": target.target_id, "max_new_tokens": max_new_tokens}
    for name, part, snaps in (("train", train_p, ws.snapshots), ("holdout", hold_p, root / "holdout")):
        progress(f"snapshot: serving {len(part)} {name} prompts × ≤{max_new_tokens} tokens (target only, capture on)")
        res = serve_and_capture(target, part, max_new_tokens, root / f"capture-{name}", "code", max_batch)
        s = seal(root / f"capture-{name}", snaps, target.target_id)
        info[name] = {"snapshot": str(s.path), "records": s.num_records, "tokens": s.num_tokens,
                      "generated_tokens": sum(map(len, res["outputs"].values())),
                      "serve_tokens_per_s": res["tokens_per_s"], "serve_seconds": res["seconds"]}
        if name == "holdout":
            write_holdout(root / "holdout.jsonl", part, res["outputs"])
    meta.write_text(json.dumps(info, indent=2))
    return info


def write_holdout(path: Path, prompts: list[tuple[str, list[int]]], outputs: dict[str, list[int]]) -> None:
    """The holdout file `replay_tau` reads: a JSON line per prompt, {"id", "workload": "code",
    "input_ids", "reference": its target-only output}."""
    path.write_text("".join(json.dumps({"id": pid, "workload": "code", "input_ids": ids, "reference": outputs[pid]})
                            + "\n" for pid, ids in prompts))


def replay_tau(target: Target, draft_dir: Path, holdout: list[dict], k: int, max_new_tokens: int,
               max_batch: int = 8) -> dict:
    """Greedy speculative replay of the holdout, batched (`cycle.replay` runs one request at a time
    to interleave configurations; here only τ matters): τ, acceptance rate, per-position acceptance
    (unconditional, vLLM's `accepted_per_pos`), mismatches vs the target-only reference outputs,
    seconds (wall), new_tokens."""
    runner = DraftRunner(load_checkpoint(draft_dir, target.embed, target.target_id).to_device(target.device))
    L = max(len(h["input_ids"]) for h in holdout) + max_new_tokens + k + 2
    eng = make_engine(EngineParams().fixed(num_draft_tokens=k, max_seq_len=L, max_batch=max_batch), target, runner)
    t0 = time.perf_counter()
    gens = eng.generate_batch([Request(h["input_ids"], max_new_tokens, True, k, request_id=h["id"]) for h in holdout])
    secs = time.perf_counter() - t0
    stats = SpecDecodingStats(k)
    for g in gens:
        stats = stats.merge(g.stats)
    m = stats.metrics()
    m["mismatches"] = sum(g.tokens != h["reference"][:max_new_tokens] for g, h in zip(gens, holdout))
    m["seconds"] = secs
    m["new_tokens"] = sum(len(g.tokens) for g in gens)
    return m


def run(params: Params, out: Path, root: Path, target: Target, train_p, hold_p, max_new_tokens: int = 256,
        fractions: tuple[float, ...] = (1.0,), init: Path | None = None,
        progress: Callable[[str], None] = print, shift: tuple[str, list, list] | None = None) -> dict:
    """The benchmark (module docstring). `train_p`/`hold_p`: (id, prompt ids) lists. `shift`:
    (workload name, train prompts, holdout prompts) for the forgetting/replay measurement, run
    warm-started from the largest fraction's draft. Returns the report."""
    t_start = time.perf_counter()
    base = root / "work" / f"candidate-{max(fractions) if fractions else 1.0}"  # the forgetting run's warm start
    if shift is not None and not fractions and not (base / "model.safetensors").exists():
        raise FileNotFoundError(f"no trained code draft at {base}: run with a data fraction of 1.0 first, with the "
                                "same --max-new-tokens/--train-prompts/--holdout-prompts (they name the snapshot dir)")
    snap = build_snapshot(root, target, train_p, hold_p, max_new_tokens, params.engine.max_batch, progress)
    holdout = [json.loads(x) for x in (root / "holdout.jsonl").read_text().splitlines()]
    hold_recs = [r for _, r in iter_records(list_snapshots(root / "holdout", target.target_id)[0])]
    ws = Workspace(root)
    k = params.engine.num_draft_tokens
    runs = []
    for frac in fractions:
        t0 = time.perf_counter()
        cp = params.model_copy(update={"curate": params.curate.model_copy(update={
            "val_fraction": 0.0, "holdout_fraction": 0.0, "window": 1, "max_tokens": 100_000})})
        cur = step_curate(ws, cp, target.target_id)
        idx = json.loads(Path(cur["curated"]).read_text())
        entries = sorted(idx["train"], key=lambda e: e["request_id"])
        entries = entries[: max(1, round(len(entries) * frac))]
        train_recs = load_records(entries, Path(cur["curated"]).parent)
        t_curate = time.perf_counter() - t0
        hold_ex: list = []

        def on_epoch(ep, draft, hold_ex=hold_ex, frac=frac):
            if not hold_ex:
                hold_ex.extend(prepare(hold_recs, target, draft.t2d, params.train.max_seq_len))
            ev = evaluate_holdout(draft, hold_ex, params.train.ttt_steps, params.train.batch_tokens)
            tau = ev.simulated_tau(k)
            progress(f"  fraction {frac}: epoch {ep} holdout acc {[round(a, 3) for a in ev.acc]} "
                     f"conditional {[round(a, 3) for a in ev.conditional(k)]} simulated τ {_f(tau)}")
            return {"holdout_acc": ev.acc, "holdout_conditional": ev.conditional(k), "holdout_simulated_tau": tau}

        cand = root / "work" / f"candidate-{frac}"
        progress(f"train: {len(train_recs)} records ({sum(int(r['input_ids'].shape[0]) for r in train_recs)} tokens), "
                 f"{params.train.epochs} epochs, ttt_steps {params.train.ttt_steps}")
        tm = train_draft(train_recs, hold_recs, target, params.draft, params.train, cand, init=init,
                         on_epoch=on_epoch)
        t1 = time.perf_counter()
        ev = replay_tau(target, cand, holdout, k, max_new_tokens, params.engine.max_batch)
        t_eval = time.perf_counter() - t1
        progress(f"  fraction {frac}: τ {ev['acceptance_length']:.2f} at k={k}, mismatches {ev['mismatches']}")
        runs.append({"fraction": frac, "train_records": len(train_recs),
                     "train_tokens_per_epoch": sum(int(r["input_ids"].shape[0]) for r in train_recs),
                     "train": {k_: v for k_, v in tm.items() if k_ != "curve"}, "curve": tm["curve"],
                     "evaluate": ev, "cycle_seconds": {"curate": t_curate, "train": tm["train_seconds"],
                                                       "evaluate": t_eval, "total": time.perf_counter() - t0}})
    shifted = None
    if shift is not None:
        shifted = forgetting(params, root, target, base, shift[0], shift[1], shift[2], max_new_tokens, progress)
    rep = {"date": time.strftime("%Y-%m-%d"), "machine": {"cpu": platform.processor() or platform.machine(),
                                                          "threads": torch.get_num_threads()},
           "target_id": target.target_id, "snapshot": snap, "num_draft_tokens": k, "max_new_tokens": max_new_tokens,
           "params": {"train": params.train.model_dump(), "draft": params.draft.model_dump()},
           "init": str(init) if init else None, "runs": runs, "forgetting": shifted,
           "wall_s": time.perf_counter() - t_start}
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.json").write_text(json.dumps(rep, indent=2))
    (out / "train.md").write_text(markdown(rep))
    return rep


def holdout_tau(target: Target, draft_dir: Path, recs: list[dict], params: Params) -> dict:
    """Teacher-forced holdout evaluation (no replay: cheap): {"acc": unconditional accuracy per TTT
    step, "conditional": conditional acceptance per position, "simulated_tau": τ at k =
    engine.num_draft_tokens from the conditional acceptances (None: no usable holdout record)}."""
    ev = holdout_accuracy(load_checkpoint(draft_dir, target.embed.float().cpu(), target.target_id).eval(), target, recs,
                          params.train)
    k = params.engine.num_draft_tokens
    return {"acc": ev.acc, "conditional": ev.conditional(k),
            "simulated_tau": ev.simulated_tau(k)}


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def forgetting(params: Params, root: Path, target: Target, base_draft: Path, name: str, train_p, hold_p,
               max_new_tokens: int, progress: Callable[[str], None] = print) -> dict:
    """A second cycle on a shifted workload `name`, warm-started from `base_draft` (trained on the
    code snapshot), once without and once with the replay buffer (curate.replay_fraction): the
    simulated τ on the code holdout (forgetting) and on the new workload's holdout (adaptation).

    Layout: `root/shift-<name>/data/snapshots/<target>/` holds a link to the code snapshot (older)
    and the new sealed snapshot, so curate's window is the new one and its replay pool the code one.
    """
    sroot = root / f"shift-{name}"
    tid = target.target_id
    meta = sroot / "snapshot.json"
    code_snap = list_snapshots(Workspace(root).snapshots, tid)[0]
    if not meta.exists():
        snaps = Workspace(sroot).snapshots / tid
        snaps.mkdir(parents=True, exist_ok=True)
        link = snaps / code_snap.name
        if not link.exists():
            link.symlink_to(code_snap.resolve())
        info = {}
        for part, prompts, dest in (
            ("train", train_p, Workspace(sroot).snapshots),
            ("holdout", hold_p, sroot / "holdout"),
        ):
            progress(f"shift {name}: serving {len(prompts)} {part} prompts × ≤{max_new_tokens} tokens")
            serve_and_capture(target, prompts, max_new_tokens, sroot / f"capture-{part}", name, params.engine.max_batch)
            s = seal(sroot / f"capture-{part}", dest, tid)
            info[part] = {"snapshot": str(s.path), "records": s.num_records, "tokens": s.num_tokens}
        meta.write_text(json.dumps(info, indent=2))
    info = json.loads(meta.read_text())
    code_hold = [r for _, r in iter_records(list_snapshots(root / "holdout", tid)[0])]
    new_hold = [r for _, r in iter_records(list_snapshots(sroot / "holdout", tid)[0])]
    res = {
        "workload": name,
        "snapshot": info,
        "base_draft": base_draft.name,
        "base": {
            "code": holdout_tau(target, base_draft, code_hold, params),
            name: holdout_tau(target, base_draft, new_hold, params),
        },
    }
    for rf in (0.0, params.curate.replay_fraction):
        cp = params.model_copy(update={"curate": params.curate.model_copy(update={
            "val_fraction": 0.0, "holdout_fraction": 0.0, "window": 1, "max_tokens": 100_000,
            "replay_fraction": rf})})
        cur = step_curate(Workspace(sroot), cp, tid)
        idx = json.loads(Path(cur["curated"]).read_text())
        cand = sroot / "work" / f"candidate-replay{rf}"
        tm = train_draft(
            load_records(idx["train"], Path(cur["curated"]).parent),
            [],
            target,
            params.draft,
            params.train,
            cand,
            init=base_draft,
        )
        r = {"replay_fraction": rf, "num_replay": idx["num_replay"], "train_records": len(idx["train"]),
             "train_seconds": tm["train_seconds"], "code": holdout_tau(target, cand, code_hold, params),
             name: holdout_tau(target, cand, new_hold, params)}
        progress(f"shift {name}, replay {rf}: code holdout simulated τ {_f(res['base']['code']['simulated_tau'])} → "
                 f"{_f(r['code']['simulated_tau'])}; {name} {_f(res['base'][name]['simulated_tau'])} → "
                 f"{_f(r[name]['simulated_tau'])}")
        res[f"replay_{rf}"] = r
    return res


def markdown(rep: dict) -> str:
    """The report `run` returns, as the markdown written to train.md (tables: τ per fraction,
    learning curve, forgetting)."""
    k = rep["num_draft_tokens"]
    s = rep["snapshot"]
    lines = [
        f"# EAGLE3 training on a fixed code snapshot ({rep['date']})",
        "",
        f"Target {rep['target_id'][:12]} (SmolLM2-135M-Instruct, fp32), {rep['machine']['threads']} CPU threads. "
        f"Snapshot: HumanEval train split, {s['train']['records']} requests, {s['train']['tokens']} tokens "
        f"({s['train']['generated_tokens']} generated, greedy, ≤{rep['max_new_tokens']} per request); holdout: "
        f"{s['holdout']['records']} disjoint problems. Params: ttt_steps {rep['params']['train']['ttt_steps']}, "
        f"epochs {rep['params']['train']['epochs']}, lr {rep['params']['train']['lr']}, draft_vocab_size "
        f"{rep['params']['draft']['draft_vocab_size']}; init: {rep['init'] or 'scratch'}.",
        "",
        f"| data | records | τ at k={k} (replay) | per-position acceptance | = target-only "
        f"| simulated τ at k={k} (holdout) "
        "| train tok/s | cycle s (curate/train/eval) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    if not rep["runs"]:  # a forgetting-only run (--fractions ''): no training table
        lines = lines[:-3]
    for r in rep["runs"]:
        e, t, c = r["evaluate"], r["train"], r["cycle_seconds"]
        pos = "/".join(f"{e[f'accepted_per_pos/{i}']:.2f}" for i in range(k))
        # the final draft on the holdout at the replay's k (the trainer's own figure is at k = ttt_steps)
        sim = r["curve"][-1]["holdout_simulated_tau"] if r["curve"] else t["simulated_acceptance_length"]
        lines.append(f"| {r['fraction']:.0%} | {r['train_records']} | {e['acceptance_length']:.2f} | {pos} | "
                     f"{'yes' if e['mismatches'] == 0 else 'NO (' + str(e['mismatches']) + ')'} | "
                     f"{_f(sim)} | {t['train_tokens_per_s']:.0f} | "
                     f"{c['total']:.0f} ({c['curate']:.0f}/{c['train']:.0f}/{c['evaluate']:.0f}) |")
    if rep["runs"]:
        lines += ["", "Learning curve (holdout, teacher-forced, after each epoch): acc_j = top-1 agreement at TTT "
                  "step j whatever steps < j did (unconditional); simulated τ at k = 1 + Σ_i Π_{j≤i} a_j from the "
                  "conditional acceptance a_j (step j right given steps < j right):", "",
                  "| data | epoch | train tokens | holdout acc_0..acc_{n} | simulated τ |", "|---|---|---|---|---|"]
    for r in rep["runs"]:
        for c in r["curve"]:
            lines.append(f"| {r['fraction']:.0%} | {c['epoch']} | {c['train_tokens']} | "
                         f"{' / '.join(f'{a:.2f}' for a in c['holdout_acc'])} | {_f(c['holdout_simulated_tau'])} |")
    f = rep.get("forgetting")
    if f:
        n = f["workload"]
        lines += [
            "",
            f"Forgetting: a second cycle on `{n}` ({f['snapshot']['train']['records']} requests), warm-started "
            f"from `{f['base_draft']}`; simulated τ at k (teacher-forced holdout, conditional acceptance):",
            "",
            f"| draft | replay records | code holdout | {n} holdout |",
            "|---|---|---|---|",
            f"| before (code draft) | - | {_f(f['base']['code']['simulated_tau'])} | "
            f"{_f(f['base'][n]['simulated_tau'])} |",
        ]
        for key in [k_ for k_ in f if k_.startswith("replay_")]:
            r = f[key]
            lines.append(f"| after, replay_fraction {r['replay_fraction']} | {r['num_replay']} | "
                         f"{_f(r['code']['simulated_tau'])} | {_f(r[n]['simulated_tau'])} |")
    lines += ["", f"Serving the snapshot: {s['train']['serve_tokens_per_s']:.1f} tok/s (batch ≤ 8, capture on). "
              f"Wall time {rep['wall_s'] / 60:.1f} min. Reproduce: `tidespec bench train` (see README)."]
    return "\n".join(lines) + "\n"


__all__ = ["run", "build_snapshot", "replay_tau", "serve_and_capture", "humaneval_prompts", "markdown"]
