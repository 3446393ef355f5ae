"""The cycle's evaluate step: replay the curated holdout with no speculation, the champion and the
candidate, side by side, greedy at a fixed k; τ per draft and whether every output equals
target-only decoding (the promotion gate's two inputs). For a target too large to replay the
holdout, `evaluate.gate: teacher_forced` compares teacher-forced simulated τ instead and replays
a subset for losslessness."""
from __future__ import annotations

import json
from pathlib import Path

from ..config import Params
from ..engine.build import make_engine
from ..engine.constraint import grammar_for
from ..engine.grammar_state import GrammarCompiler, GrammarError
from ..engine.replay import replay
from ..models.eagle3 import load_checkpoint
from ..models.load import get_target, runner_for
from ..train.holdout import holdout_accuracy
from ..train.online import online
from ..train.source import IndexRecords
from ..workspace import Workspace, engine_dir, served_version
from .train_data import remote_shards, train_rehydrator


def read_eval_prompts(path: Path) -> list[dict]:
    """Rows {id, workload, input_ids} of a holdout file. Raises FileNotFoundError (run curate) or
    ValueError (empty: no holdout traffic)."""
    if not Path(path).exists():
        raise FileNotFoundError(f"holdout prompts {path} missing; run `tidespec stage curate` (or the flow) first")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no holdout requests: capture more traffic or raise curate.holdout_fraction")
    return rows


def constrained(prompts: list[dict], target, tok) -> list[dict]:
    """Holdout rows with a captured constraint spec get its compiled grammar (`"compiled_grammar"`), so replay
    constrains them as they were served. Raises ValueError when a constrained row cannot be compiled
    (it names the row) or there is no tokenizer to compile it for."""
    if not any("constraint" in p for p in prompts):
        return prompts
    if tok is None:
        raise ValueError("the holdout holds constrained requests (response_format / tools) but the target has no "
                         "tokenizer to compile their grammars")
    gc = GrammarCompiler.for_target(target, tok)
    out = []
    for p in prompts:
        if "constraint" in p:
            try:
                p = p | {"compiled_grammar": grammar_for(p["constraint"], gc)}
            except (GrammarError, KeyError, TypeError) as err:
                raise ValueError(
                    f"holdout request {p['id']}: its captured constraint cannot be compiled: {err}"
                ) from None
        out.append(p)
    return out


def step_evaluate(ws: Workspace, params: Params, candidate: Path, champion: Path | None,
                  prompts_path: Path, out: Path, progress=None, curated: Path | None = None) -> dict:
    """Evaluate the candidate against the champion for the promotion gate (`evaluate.gate`).

    `replay`: replay the holdout with no speculation, the champion and the candidate, side by side
    (interleaved per wave of `evaluate.concurrency` requests, one engine batch each; fixed k =
    engine.num_draft_tokens). `teacher_forced`: `teacher_forced_gate`.

    Report: {"baseline": m, "champion": m | None, "candidate": m, "lossless": bool,
    "speedup": {...}, "gate": "replay" | "teacher_forced", "holdout_split": "random" | "time",
    "concurrency": c, "num_prompts"} where
    each m is `replay`'s metrics (τ as `acceptance_length`, `accepted_per_pos/j`, tokens/s, ...).
    Lossless = the candidate's and the champion's greedy outputs equal the baseline's (target-only,
    same waves) token for token; "gate" names what the promotion gate compares. `curated`: the
    curated index whose holdout `prompts_path` is (default `ws.curated`; a class draft's subset).
    """
    target, tok = get_target(params)
    curated = Path(curated) if curated is not None else ws.curated
    prompts = constrained(read_eval_prompts(prompts_path), target, tok)
    if params.evaluate.gate == "teacher_forced":
        rep = teacher_forced_gate(ws, params, target, candidate, champion, prompts, progress, curated)
    else:
        rep = _replay_gate(params, target, candidate, champion, prompts, progress)
    bt = rep["baseline"]["tokens_per_s"] or 1.0
    rep["speedup"] = {k: rep[k]["tokens_per_s"] / bt for k in ("champion", "candidate")
                      if rep[k] and rep[k].get("tokens_per_s") is not None}
    if curated.exists():  # which holdout the gate scores (curate.holdout_split)
        rep["holdout_split"] = json.loads(curated.read_text()).get("holdout_split", "random")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2))
    return rep


def _engine(params: Params, target, runner, name):
    """An evaluation engine: τ of the draft alone, no grammar-forced proposals (constrained prompts
    keep their masks)."""
    e, c = params.engine, params.evaluate.concurrency
    return make_engine(e.fixed(max_batch=max(e.max_batch, c)), target, runner, version=name, forced_tokens=False)


def _replay_gate(params: Params, target, candidate: Path, champion: Path | None, prompts: list[dict],
                 progress=None) -> dict:
    n, c = params.evaluate.max_new_tokens, params.evaluate.concurrency
    configs = {"baseline": (_engine(params, target, None, None), False)}
    champ = runner_for(champion, target)
    if champ is not None:
        configs["champion"] = (_engine(params, target, champ, "champion"), True)
    configs["candidate"] = (_engine(params, target, runner_for(candidate, target), "candidate"), True)
    runs = replay(configs, prompts, n, reference="baseline", progress=progress, concurrency=c)
    rep = {"baseline": runs["baseline"]["metrics"], "num_prompts": len(prompts), "max_new_tokens": n,
           "gate": "replay", "concurrency": c, "num_draft_tokens": params.engine.num_draft_tokens,
           "champion_version": served_version(champion) if champ is not None else None,
           "champion": runs["champion"]["metrics"] if champ is not None else None,
           "candidate": runs["candidate"]["metrics"]}
    rep["lossless"] = rep["candidate"]["mismatches"] == 0 and (champ is None or rep["champion"]["mismatches"] == 0)
    return rep


def teacher_forced_metrics(draft_dir: Path, target, records: list[dict], params: Params) -> dict:
    """A draft's teacher-forced figures over capture records, in the replay's metric names:
    `acceptance_length` = the simulated τ at k = engine.num_draft_tokens (capped at train.ttt_steps;
    `train.holdout.HoldoutEval.simulated_tau`), `accepted_per_pos/j` = Π_{i≤j} a_i (the share of
    chains whose first j+1 drafts are accepted, vLLM's per-position counter over num_drafts),
    `num_drafts` = the chains greedy decoding would run, `cond_acceptance/j` = a_j. Raises
    ValueError when no record is usable."""
    draft = load_checkpoint(engine_dir(draft_dir), target.embed.float().cpu(), target.target_id).eval()
    ev = holdout_accuracy(draft, target, records, params.train)
    k = params.engine.num_draft_tokens
    tau = ev.simulated_tau(k)
    if tau is None:
        raise ValueError("no holdout record is usable for the teacher-forced gate (every one dropped): capture more "
                         "traffic, or set evaluate.gate: replay")
    m, run = {"acceptance_length": tau, "num_drafts": float(ev.chains(k))}, 1.0
    for j, a in enumerate(ev.conditional(k)):
        run *= a
        m[f"accepted_per_pos/{j}"], m[f"cond_acceptance/{j}"] = run, a
    return m


def teacher_forced_gate(ws: Workspace, params: Params, target, candidate: Path, champion: Path | None,
                        prompts: list[dict], progress=None, curated: Path | None = None) -> dict:
    """`evaluate.gate: teacher_forced`, for a target too large to replay the holdout: each draft's
    `teacher_forced_metrics` over the curated holdout's records (read as the trainer reads them:
    online for tokens-only records, from the DVC remote for missing shards), and the first
    `evaluate.replay_subset` (4) holdout prompts replayed with no speculation and with the candidate:
    its outputs must equal target-only (lossless) and give its tokens/s. The candidate's metrics are
    the subset replay's, with τ and per-position acceptance the teacher-forced ones (the replayed
    τ kept as `replay_acceptance_length`). `curated`: the index of those records (default
    `ws.curated`). Raises FileNotFoundError without a curated index."""
    ev = params.evaluate
    curated = Path(curated) if curated is not None else ws.curated
    idx = json.loads(curated.read_text())
    shards = remote_shards(params, ws.root)
    with train_rehydrator(params, target, curated, ws.state) as rh:
        src = online(IndexRecords(idx["holdout"], curated.parent, shards), rh, target)
        records = [src.read(i) for i in range(len(src))]
    sub = prompts[: ev.replay_subset or 4]
    configs = {"baseline": (_engine(params, target, None, None), False),
               "candidate": (_engine(params, target, runner_for(candidate, target), "candidate"), True)}
    runs = replay(configs, sub, ev.max_new_tokens, reference="baseline", progress=progress,
                  concurrency=ev.concurrency)
    cand = runs["candidate"]["metrics"]
    cand = ({k: v for k, v in cand.items() if not k.startswith(("accepted_per_pos/", "acceptance_length"))}
            | {"replay_acceptance_length": cand["acceptance_length"]}
            | teacher_forced_metrics(candidate, target, records, params))
    champ = teacher_forced_metrics(champion, target, records, params) if champion and Path(champion).exists() else None
    return {"baseline": runs["baseline"]["metrics"], "num_prompts": len(sub), "max_new_tokens": ev.max_new_tokens,
            "gate": "teacher_forced", "holdout_records": len(records), "concurrency": ev.concurrency,
            "num_draft_tokens": params.engine.num_draft_tokens,
            "champion_version": served_version(champion) if champ is not None else None,
            "champion": champ, "candidate": cand, "lossless": cand["mismatches"] == 0}


# -- register / deploy ------------------------------------------------------------------------
