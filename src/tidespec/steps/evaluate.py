"""The cycle's evaluate step: the candidate against the champion on the curated holdout, measured
by `train.evaluation.evaluate_candidate` (`evaluate.gate`: `replay` replays the holdout with no
speculation, the champion and the candidate side by side; `teacher_forced`, for a target too large
to replay it, compares teacher-forced simulated τ and replays a subset for losslessness); this step
reads the holdout, and records the report with its speedups."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from ..config import Params
from ..models.load import get_target
from ..train.evaluation import Holdout, evaluate_candidate, retained_check
from ..workspace import Workspace
from .train_data import holds_tokens_only, remote_shards, train_rehydrator

log = logging.getLogger(__name__)


def read_eval_prompts(path: Path) -> list[dict]:
    """Rows {id, workload, input_ids} of a holdout file. Raises FileNotFoundError (run curate) or
    ValueError (empty: no holdout traffic)."""
    if not Path(path).exists():
        raise FileNotFoundError(f"holdout prompts {path} missing; run `tidespec stage curate` (or the flow) first")
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no holdout requests: capture more traffic or raise curate.holdout_fraction")
    return rows


def step_evaluate(ws: Workspace, params: Params, candidate: Path, champion: Path | None,
                  prompts_path: Path, out: Path, progress=None, curated: Path | None = None) -> dict:
    """Evaluate the candidate against the champion for the promotion gate (`evaluate.gate`), on the
    holdout prompts of `prompts_path` (`read_eval_prompts`) and, for `teacher_forced`, the records
    of the curated index `curated` (default `ws.curated`; a class draft's subset), read as the
    trainer reads them (online for tokens-only records, from the DVC remote for missing shards).

    Report, also written to `out`: `train.evaluation.evaluate_candidate`'s, plus "speedup"
    {"champion"?, "candidate"?: tokens/s over the baseline's} and "holdout_split" ("random" |
    "time": how curate split the holdout off). Raises as `read_eval_prompts` and
    `evaluate_candidate`."""
    curated = Path(curated) if curated is not None else ws.curated
    target, tok = get_target(params)
    prompts = read_eval_prompts(prompts_path)
    holdout = None
    if params.evaluate.gate == "teacher_forced":  # its records are read as the trainer reads them
        rehydrator = train_rehydrator(params, target, curated, ws.state)  # entered while they are read
        holdout = Holdout(curated, rehydrator, remote_shards(params.train, ws.root))
    rep = evaluate_candidate(params, target, tok, candidate, champion, prompts, holdout, progress)
    rep["retained"], err = _retained(ws, params, target, curated, candidate, champion)
    if err:
        rep["retained_error"] = err
    bt = rep["baseline"]["tokens_per_s"] or 1.0
    rep["speedup"] = {k: rep[k]["tokens_per_s"] / bt for k in ("champion", "candidate")
                      if rep[k] and rep[k].get("tokens_per_s") is not None}
    for w, r in rep["retained"].items():  # logged with the candidate's version (steps.register)
        rep["candidate"][f"retained_tau/{w}"] = r["candidate"]
        if r["forgetting"] is not None:
            rep["candidate"][f"retained_forgetting/{w}"] = r["forgetting"]
    if curated.exists():  # which holdout the gate scores (curate.holdout_split)
        rep["holdout_split"] = json.loads(curated.read_text()).get("holdout_split", "random")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2))
    return rep


def _retained(ws: Workspace, params: Params, target, curated: Path, candidate: Path,
              champion: Path | None) -> tuple[dict, str | None]:
    """(`train.evaluation.retained_check` on the curated index's retained holdout, read as the trainer
    reads it; None) — ({}, None) without one, ({}, why) when it cannot be read or scored (logged; the
    cycle goes on, the report and the decision's reason say so)."""
    retained = json.loads(curated.read_text()).get("retained_holdout") if curated.exists() else None
    if not retained:
        return {}, None
    if params.ingest.rehydrate_backend != "embedded" and holds_tokens_only(curated):
        return {}, ("retained holdout not scored: tokens-only records with ingest.rehydrate_backend vllm would "
                    "start an extraction server for it (rehydrate_backend embedded scores them with the target here)")
    src = Holdout(curated, train_rehydrator(params, target, curated, ws.state), remote_shards(params.train, ws.root))
    flat = [(w, e) for w, entries in retained.items() for e in entries]  # one read: the rehydrator is entered once
    records: dict[str, list[dict]] = {}
    try:
        for (w, _), rec in zip(flat, src.records(target, [e for _, e in flat])):
            records.setdefault(w, []).append(rec)
        return retained_check(candidate, champion, target, records, params.train, params.engine.num_draft_tokens), None
    except (OSError, ValueError, RuntimeError) as e:  # a shard gone, a rehydration server or memory failing
        log.warning("retained holdout not scored (%s): forgetting not measured this cycle", e)
        return {}, f"retained holdout not scored: {e}"



# -- register / deploy ------------------------------------------------------------------------
