"""The cycle's evaluate step: replay the curated holdout with no speculation, the champion and the
candidate, side by side, greedy at a fixed k; τ per draft and whether every output equals
target-only decoding (the promotion gate's two inputs)."""
from __future__ import annotations

import json
from pathlib import Path

from ..config import Params
from ..engine.build import make_engine
from ..engine.constraint import grammar_for
from ..engine.grammar import GrammarCompiler, GrammarError
from ..engine.replay import replay
from ..models.load import get_target, runner_for
from ..workspace import Workspace, served_version


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
                  prompts_path: Path, out: Path, progress=None) -> dict:
    """Replay the holdout with no speculation, the champion and the candidate, side by side
    (interleaved per wave of `evaluate.concurrency` requests, one engine batch each; fixed k =
    engine.num_draft_tokens).

    Report: {"baseline": m, "champion": m | None, "candidate": m, "lossless": bool,
    "speedup": {...}, "gate": "replay", "concurrency": c} where each m is `replay`'s metrics.
    Lossless = the candidate's and the champion's greedy outputs equal the baseline's (target-only,
    same waves) token for token; "gate" names what the promotion gate compares (τ replayed).
    """
    target, tok = get_target(params)
    prompts = constrained(read_eval_prompts(prompts_path), target, tok)
    n, c = params.evaluate.max_new_tokens, params.evaluate.concurrency
    e = params.engine

    def engine(
        runner, name
    ):  # τ of the draft alone: no grammar-forced proposals (constrained prompts keep their masks)
        return make_engine(e.fixed(max_batch=max(e.max_batch, c)), target, runner, version=name,
                           forced_tokens=False)

    configs = {"baseline": (engine(None, None), False)}
    champ = runner_for(champion, target)
    if champ is not None:
        configs["champion"] = (engine(champ, "champion"), True)
    configs["candidate"] = (engine(runner_for(candidate, target), "candidate"), True)
    runs = replay(configs, prompts, n, reference="baseline", progress=progress, concurrency=c)
    rep = {"baseline": runs["baseline"]["metrics"], "num_prompts": len(prompts), "max_new_tokens": n,
           "gate": "replay", "concurrency": c,
           "num_draft_tokens": e.num_draft_tokens,
           "champion_version": served_version(champion) if champ is not None else None,
           "champion": runs["champion"]["metrics"] if champ is not None else None,
           "candidate": runs["candidate"]["metrics"]}
    rep["lossless"] = rep["candidate"]["mismatches"] == 0 and (champ is None or rep["champion"]["mismatches"] == 0)
    bt = rep["baseline"]["tokens_per_s"] or 1.0
    rep["speedup"] = {k: rep[k]["tokens_per_s"] / bt for k in ("champion", "candidate") if rep[k]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2))
    return rep


# -- register / deploy ------------------------------------------------------------------------
