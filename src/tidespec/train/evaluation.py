"""The promotion gate's measurements (`evaluate.gate`): a candidate draft against the champion and
target-only decoding on the curated holdout. `evaluate_candidate` loads the drafts for the target,
replays the holdout and, for `teacher_forced`, scores each draft teacher-forced on the holdout's
records (`train.holdout`); the cycle's evaluate step (`steps.evaluate`) loads the target, names where
the holdout's records come from (`Holdout`) and records the report.

`replay`: replay the holdout with no speculation, the champion and the candidate, side by side
(interleaved per wave of `evaluate.concurrency` requests, one engine batch each; fixed k =
engine.num_draft_tokens). `teacher_forced`, for a target too large to replay the holdout: each
draft's `teacher_forced_metrics` over the holdout's records, and the first `evaluate.replay_subset`
prompts replayed with no speculation and with the candidate, for losslessness and tokens/s.
"""
from __future__ import annotations

import json
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from ..capture.ingest import Rehydrator
from ..config import EngineParams, Params, TrainParams
from ..engine.build import make_engine
from ..engine.constraint import grammar_for
from ..engine.grammar_state import GrammarCompiler, GrammarError
from ..engine.replay import replay
from ..models.load import runner_for
from ..models.target import Target
from ..workspace import engine_dir, served_version
from .holdout import checkpoint_accuracy
from .online import online
from .source import IndexRecords, ShardLocator


def constrained(prompts: list[dict], target: Target, tok) -> list[dict]:
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


@dataclass(frozen=True)
class Holdout:
    """Where `evaluate.gate: teacher_forced` reads the curated holdout's capture records, as the
    trainer reads them: `curated` (the index), `rehydrator` (a context manager yielding the
    rehydrator of its tokens-only records, None: the target here; entered only while they are read,
    so a server it starts is stopped before any evaluation engine is built), `shards` (where a
    shard the workspace lacks comes from; None: it must be here)."""

    curated: Path
    rehydrator: AbstractContextManager[Rehydrator | None]
    shards: ShardLocator | None = None

    def records(self, target: Target, entries: list[dict] | None = None) -> list[dict]:
        """The records of `entries` (index entries relative to the index; None: the holdout's), tensors
        as `capture.store` documents them. Raises FileNotFoundError without a curated index."""
        if entries is None:
            entries = json.loads(Path(self.curated).read_text())["holdout"]
        with self.rehydrator as rh:
            src = online(IndexRecords(entries, Path(self.curated).parent, self.shards), rh, target)
            return [src.read(i) for i in range(len(src))]


def teacher_forced_metrics(draft_dir: Path, target: Target, records: list[dict], tparams: TrainParams,
                           k: int) -> dict:
    """A draft's teacher-forced figures over capture records, in the replay's metric names:
    `acceptance_length` = the simulated τ at k drafts (the engine's num_draft_tokens; capped at
    `tparams.ttt_steps`: `train.holdout.HoldoutEval.simulated_tau`), `accepted_per_pos/j` =
    Π_{i≤j} a_i (the share of chains whose first j+1 drafts are accepted, vLLM's per-position
    counter over num_drafts), `num_drafts` = the chains greedy decoding would run,
    `cond_acceptance/j` = a_j. Raises ValueError when no record is usable."""
    ev = checkpoint_accuracy(engine_dir(draft_dir), target, records, tparams)
    tau = ev.simulated_tau(k)
    if tau is None:
        raise ValueError("no holdout record is usable for the teacher-forced gate (every one dropped): capture more "
                         "traffic, or set evaluate.gate: replay")
    m, run = {"acceptance_length": tau, "num_drafts": float(ev.chains(k))}, 1.0
    for j, a in enumerate(ev.conditional(k)):
        run *= a
        m[f"accepted_per_pos/{j}"], m[f"cond_acceptance/{j}"] = run, a
    return m


def evaluate_candidate(params: Params, target: Target, tok, candidate: Path, champion: Path | None,
                       prompts: list[dict], holdout: Holdout | None = None, progress=None) -> dict:
    """The promotion gate's report on `candidate` against `champion` (None or a missing dir: no
    champion) over the holdout `prompts` (rows {id, workload, input_ids, constraint?}: a
    constraint is compiled for the target's tokenizer `tok`, `constrained`) and, for
    `evaluate.gate: teacher_forced`, the capture records of `holdout` (required then).

    Report: {"baseline": m, "champion": m | None, "candidate": m, "lossless": bool, "gate",
    "num_prompts", "max_new_tokens", "concurrency", "num_draft_tokens", "champion_version"} (and
    "holdout_records" for `teacher_forced`), each m `engine.replay.replay`'s metrics (τ as
    `acceptance_length`, `accepted_per_pos/j`, tokens/s, ...). Lossless = the candidate's (and for
    `replay` the champion's) greedy outputs equal the baseline's (target-only, same waves) token for
    token. For `teacher_forced` the candidate's metrics are the subset replay's, with τ and
    per-position acceptance the teacher-forced ones (the replayed τ kept as
    `replay_acceptance_length`), and the champion's the teacher-forced ones alone. Raises
    ValueError as `constrained`, `teacher_forced_metrics` and `models.load.runner_for`, or for
    `teacher_forced` without a holdout; FileNotFoundError as `Holdout.records`."""
    ev, k = params.evaluate, params.engine.num_draft_tokens
    teacher_forced = ev.gate == "teacher_forced"
    prompts = constrained(prompts, target, tok)
    if teacher_forced:
        if holdout is None:
            raise ValueError("evaluate.gate teacher_forced scores the holdout's records: pass the holdout")
        records = holdout.records(target)
        prompts = prompts[: ev.replay_subset or 4]
    champ = None if teacher_forced else runner_for(champion, target)
    runners = {"baseline": None} | ({"champion": champ} if champ is not None else {})
    runners["candidate"] = runner_for(candidate, target)
    runs = replay_drafts(params.engine, target, runners, prompts, ev.max_new_tokens, ev.concurrency, progress)
    rep = {"baseline": runs["baseline"], "num_prompts": len(prompts), "max_new_tokens": ev.max_new_tokens,
           "gate": ev.gate}
    cand, champ_m = runs["candidate"], runs.get("champion")
    if teacher_forced:
        replayed_only = ("accepted_per_pos/", "acceptance_length", "tau_se/")
        cand = ({m: v for m, v in cand.items() if not m.startswith(replayed_only)}
                | {"replay_acceptance_length": cand["acceptance_length"]}
                | teacher_forced_metrics(candidate, target, records, params.train, k))
        if champion and Path(champion).exists():
            champ_m = teacher_forced_metrics(champion, target, records, params.train, k)
        rep["holdout_records"] = len(records)
    rep |= {"concurrency": ev.concurrency, "num_draft_tokens": k,
            "champion_version": served_version(champion) if champ_m is not None else None,
            "champion": champ_m, "candidate": cand}
    rep["lossless"] = all(rep[a]["mismatches"] == 0 for a in runs if a != "baseline")
    return rep


def retained_check(candidate: Path, champion: Path | None, target: Target, retained: dict[str, list[dict]],
                   tparams: TrainParams, k: int) -> dict[str, dict]:
    """Forgetting on the retained holdout (`capture.replay_buffer`: per class, earlier requests no draft
    was trained on): each class's teacher-forced simulated τ at k (`teacher_forced_metrics`) for the
    candidate and the champion, on the same records (`retained`: {class: capture records}; each draft
    is loaded once per class). Returns {class: {"records" (count), "candidate", "champion" (τ in
    tokens per target forward; champion None without one), "forgetting" (1 − candidate / champion, a
    share: 0.05 = 5 % lost; None without a champion)}}; a class whose records are all unusable is left
    out."""
    out = {}
    for w, records in sorted(retained.items()):
        try:
            cand = teacher_forced_metrics(candidate, target, records, tparams, k)["acceptance_length"]
            champ = (teacher_forced_metrics(champion, target, records, tparams, k)["acceptance_length"]
                     if champion and Path(champion).exists() else None)
        except ValueError:  # every record dropped (too short, out of the draft vocabulary)
            continue
        out[w] = {"records": len(records), "candidate": cand, "champion": champ,
                  "forgetting": None if not champ else 1.0 - cand / champ}
    return out


def replay_drafts(cfg: EngineParams, target: Target, runners: dict, prompts: list[dict], max_new_tokens: int,
                  concurrency: int, progress=None) -> dict[str, dict]:
    """Each arm's `engine.replay.replay` metrics over `prompts`, arms (name → draft runner, None:
    no speculation) replayed side by side against the first one, `concurrency` requests a wave.
    Every arm's engine is an evaluation engine: `cfg.fixed()` with a max_batch of at least
    `concurrency`, τ of the draft alone (no grammar-forced proposals; constrained prompts keep
    their masks)."""
    fixed = cfg.fixed(max_batch=max(cfg.max_batch, concurrency))
    configs = {name: (make_engine(fixed, target, r, version=None if r is None else name, forced_tokens=False),
                      r is not None) for name, r in runners.items()}
    runs = replay(configs, prompts, max_new_tokens, reference=next(iter(runners)), progress=progress,
                  concurrency=concurrency)
    return {name: run["metrics"] for name, run in runs.items()}
