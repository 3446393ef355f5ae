"""The cycle's evaluate step: the candidate against the champion on the curated holdout, measured
by `train.evaluation.evaluate_candidate` (`evaluate.gate`: `replay` replays the holdout with no
speculation, the champion and the candidate side by side; `teacher_forced`, for a target too large
to replay it, compares teacher-forced simulated τ and replays a subset for losslessness); this step
reads the holdout, and records the report with its speedups."""
from __future__ import annotations

import json
from pathlib import Path

from ..config import Params
from ..models.load import get_target
from ..train.evaluation import Holdout, evaluate_candidate
from ..workspace import Workspace
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
    bt = rep["baseline"]["tokens_per_s"] or 1.0
    rep["speedup"] = {k: rep[k]["tokens_per_s"] / bt for k in ("champion", "candidate")
                      if rep[k] and rep[k].get("tokens_per_s") is not None}
    if curated.exists():  # which holdout the gate scores (curate.holdout_split)
        rep["holdout_split"] = json.loads(curated.read_text()).get("holdout_split", "random")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2))
    return rep



# -- register / deploy ------------------------------------------------------------------------
