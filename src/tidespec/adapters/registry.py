"""MLflow model registry for EAGLE3 drafts (README, "Orchestration and the registry").

Names: experiment ``tidespec/<target_id[:12]>``, registered model ``tidespec-draft-<target_id[:12]>``.
Aliases: ``challenger`` (last candidate), ``champion`` (serving). MLflow keeps no alias history,
so the registered model carries a tag ``champion_history`` = comma-separated versions, oldest
first, current champion last; ``rollback`` pops it.

A model version's ``source`` is the run's ``draft/`` artifact directory: exactly config.json +
model.safetensors, what vLLM (``speculative_config.model``) and SGLang
(``--speculative-draft-model-path``) load as downloaded; the rest of the checkpoint (suffix corpus,
train_metrics.json) is the run's ``sidecars/``. Downloads rebuild a draft bundle
(``workspace.make_bundle``: ``draft/`` + sidecars beside it). There is no pyfunc flavour. Every function takes the
tracking URI explicitly and uses its own ``MlflowClient``; no global MLflow state is touched.

One file (~500 lines): logging, the alias history, the promotion gate and its audit trail share
the registry's conventions (names, tags) and are tested together against a real MLflow server.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from ..errors import TidespecError
from ..workspace import bundle_files, make_bundle, write_version

CHAMPION = "champion"
CHALLENGER = "challenger"
HISTORY_TAG = "champion_history"
HISTORY_MAX = 500  # champions kept in the history tag (MLflow tag values ≤ 5000 chars)
ARTIFACT_DIR = "draft"
SIDECAR_DIR = "sidecars"
VERSION_TAG_KEYS = ("target_id", "snapshot_rev", "params_sha", "workload_mix",
                    "acceptance_length", "baseline_acceptance_length")
_BATCH = {"metrics": 1000, "params": 100, "tags": 100}  # MLflow log_batch limits per call


class RegistryError(TidespecError):
    """A registry operation is impossible as asked; the message names the fix."""


@dataclass(frozen=True)
class Decision:
    """Outcome of a promotion/rollback: ``version`` is the one decided about."""

    promoted: bool
    reason: str
    version: str
    previous_champion: str | None


@dataclass(frozen=True)
class ModelVersionInfo:
    version: str
    run_id: str | None
    source: str
    tags: dict[str, str]


# ---------------------------------------------------------------- names / client


FIRST_TOKEN_TAG = "first_token_acceptance"  # a version's replayed a₁ per class (JSON), `replayed`


def experiment_name(target_id: str) -> str:
    return f"tidespec/{target_id[:12]}"


def model_name(target_id: str) -> str:
    return f"tidespec-draft-{target_id[:12]}"


def _client(tracking_uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _not_found(e: MlflowException) -> bool:
    return e.error_code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND")


def ensure_experiment(tracking_uri: str, target_id: str) -> str:
    """Experiment id of ``experiment_name(target_id)``, created if missing."""
    c = _client(tracking_uri)
    name = experiment_name(target_id)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            c.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    try:
        return c.create_experiment(name, tags={"target_id": target_id})
    except MlflowException:  # lost a creation race
        return c.get_experiment_by_name(name).experiment_id


def ensure_registered_model(tracking_uri: str, target_id: str) -> str:
    """Name of the registered model for ``target_id``, created (tagged ``target_id``) if missing."""
    c = _client(tracking_uri)
    name = model_name(target_id)
    try:
        c.get_registered_model(name)
    except MlflowException as e:
        if not _not_found(e):
            raise
        try:
            c.create_registered_model(name, tags={"target_id": target_id},
                                      description=f"EAGLE3 draft for target {target_id}")
        except MlflowException as e2:
            if e2.error_code not in ("RESOURCE_ALREADY_EXISTS", "ALREADY_EXISTS"):
                raise
    return name


# ---------------------------------------------------------------- logging a candidate


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"a": {"b": 1}} -> {"a.b": "1"}``; values stringified (MLflow params are strings)."""
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= _flatten(v, f"{key}.")
        else:
            out[key] = str(v)[:6000]  # MLflow param value limit
    return out


def _chunks(xs: list, n: int):
    for i in range(0, len(xs), n):
        yield xs[i:i + n]


def _log_batched(c: MlflowClient, run_id: str, metrics=(), params=(), tags=()) -> None:
    for kind, items in (("metrics", list(metrics)), ("params", list(params)), ("tags", list(tags))):
        for chunk in _chunks(items, _BATCH[kind]):
            c.log_batch(run_id, **{kind: chunk})


def _fmt(x: float) -> str:
    return repr(float(x))


def log_candidate(tracking_uri: str, target_id: str, checkpoint_dir: Path, params: dict,
                  metrics: dict[str, float], tags: dict[str, str],
                  step_metrics: dict[str, list[float]] | None = None,
                  run_name: str | None = None) -> tuple[str, str]:
    """Log a trained draft as a run + new model version, alias ``challenger``.

    ``params`` may be nested (flattened to ``a.b``); ``metrics`` are final values (names may
    contain ``/``, e.g. ``accepted_per_pos/0``); ``step_metrics`` are per-step series (e.g.
    ``train/loss``, step = list index). ``checkpoint_dir`` (flat or a bundle) is uploaded as
    ``draft/`` (config.json + model.safetensors) and ``sidecars/`` (every other file). Version tags = ``tags`` + ``target_id`` + the metrics ``acceptance_length`` and
    ``baseline_acceptance_length`` when given. Returns ``(run_id, version)``.
    Raises FileNotFoundError if ``checkpoint_dir`` is not a directory; MlflowException on server errors.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise FileNotFoundError(f"checkpoint dir {checkpoint_dir} does not exist; train/export a draft first")
    c = _client(tracking_uri)
    exp_id = ensure_experiment(tracking_uri, target_id)
    name = ensure_registered_model(tracking_uri, target_id)
    vtags = {k: str(v) for k, v in tags.items()} | {"target_id": target_id}
    for k in ("acceptance_length", "baseline_acceptance_length"):
        if k in metrics:
            vtags[k] = _fmt(metrics[k])
    run = c.create_run(exp_id, run_name=run_name, tags=vtags)
    run_id = run.info.run_id
    try:
        now = int(time.time() * 1000)
        ms = [Metric(k, float(v), now, 0) for k, v in metrics.items()]
        for k, series in (step_metrics or {}).items():
            ms += [Metric(k, float(v), now, i) for i, v in enumerate(series)]
        _log_batched(c, run_id, metrics=ms,
                     params=[Param(k, v) for k, v in _flatten(params).items()])
        engine, side = bundle_files(checkpoint_dir)
        for f in engine:
            c.log_artifact(run_id, str(f), ARTIFACT_DIR)
        for f in side:
            c.log_artifact(run_id, str(f), SIDECAR_DIR)
    except BaseException:
        c.set_terminated(run_id, "FAILED")
        raise
    c.set_terminated(run_id, "FINISHED")
    mv = c.create_model_version(name, source=f"{run.info.artifact_uri}/{ARTIFACT_DIR}",
                                run_id=run_id, tags=vtags)
    c.set_registered_model_alias(name, CHALLENGER, mv.version)
    return run_id, str(mv.version)


# ---------------------------------------------------------------- champion / history


def _version(c: MlflowClient, name: str, version) -> str:
    """``version`` normalised ("01", " 1" → "1") and checked to exist. Raises RegistryError."""
    v = str(version).strip()
    if not v.isdigit() or int(v) < 1:
        raise RegistryError(f"{name}: version {version!r} is not a version number (1, 2, ...)")
    v = str(int(v))
    try:
        c.get_model_version(name, v)
    except MlflowException as e:
        if _not_found(e) or e.error_code == "INVALID_PARAMETER_VALUE":
            raise RegistryError(f"{name} has no version {v}; see the versions in the MLflow UI") from None
        raise
    return v


def _alias_version(c: MlflowClient, name: str, alias: str) -> str | None:
    try:
        return str(c.get_model_version_by_alias(name, alias).version)
    except MlflowException as e:
        if _not_found(e) or e.error_code == "INVALID_PARAMETER_VALUE":
            return None
        raise


def _exists(c: MlflowClient, name: str, version: str) -> bool:
    try:
        c.get_model_version(name, version)
        return True
    except MlflowException as e:
        if _not_found(e) or e.error_code == "INVALID_PARAMETER_VALUE":
            return False
        raise


def _history(c: MlflowClient, name: str) -> list[str]:
    raw = c.get_registered_model(name).tags.get(HISTORY_TAG, "")
    return [v for v in raw.split(",") if v]


def _set_history(c: MlflowClient, name: str, hist: list[str]) -> None:
    c.set_registered_model_tag(name, HISTORY_TAG, ",".join(hist))


def _record(c: MlflowClient, name: str, version: str, decision: str, reason: str) -> None:
    """Write ``decision``/``decision_reason`` (the latest) on the version and on its run, and append
    the decision to the audit trail: tag ``decision.<n>`` = ``<UTC time> <decision>: <reason>``
    (n = 0, 1, ...; never overwritten)."""
    mv = c.get_model_version(name, version)
    n = sum(k.startswith("decision.") for k in mv.tags)
    at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    entry = f"{at} {decision}: {reason}"[:5000]
    for k, v in (("decision", decision), ("decision_reason", reason[:5000]), (f"decision.{n}", entry)):
        c.set_model_version_tag(name, version, k, v)
    if mv.run_id:
        c.log_batch(mv.run_id, tags=[RunTag("decision", decision), RunTag("decision_reason", reason[:5000]),
                                     RunTag(f"decision.{n}", entry)])


def decisions(tracking_uri: str, target_id: str, version: str) -> list[str]:
    """The audit trail of ``version``: every decision recorded on it, oldest first."""
    tags = _client(tracking_uri).get_model_version(model_name(target_id), str(version)).tags
    return [tags[f"decision.{i}"] for i in range(sum(k.startswith("decision.") for k in tags))]


def log_live(tracking_uri: str, target_id: str, version: str, metrics: dict[str, float], step: int,
             tags: dict[str, str] | None = None) -> None:
    """Log a served version's live figures (names prefixed ``live/``, e.g. ``live/acceptance_length``,
    ``live/accepted_per_pos/0``) to its run at ``step`` (the engine's draft count: monotone), and set
    ``tags`` on the version and its run. Raises MlflowException on server errors."""
    c = _client(tracking_uri)
    mv = c.get_model_version(model_name(target_id), str(version))
    now = int(time.time() * 1000)
    if mv.run_id:
        _log_batched(c, mv.run_id, metrics=[Metric(f"live/{k}", float(v), now, step) for k, v in metrics.items()],
                     tags=[RunTag(k, v) for k, v in (tags or {}).items()])
    for k, v in (tags or {}).items():
        c.set_model_version_tag(model_name(target_id), str(version), k, v)


def _make_champion(c: MlflowClient, name: str, version: str) -> str | None:
    """Move alias ``champion`` to ``version``, append it to the history; return the previous champion."""
    prev = _alias_version(c, name, CHAMPION)
    c.set_registered_model_alias(name, CHAMPION, version)
    hist = _history(c, name)
    if prev and (not hist or hist[-1] != prev):  # alias moved outside tidespec: keep it traceable
        hist.append(prev)
    _set_history(c, name, (hist + [version])[-HISTORY_MAX:])
    return prev


def champion(tracking_uri: str, target_id: str) -> ModelVersionInfo | None:
    """The version under alias ``champion``, or None (no model or no champion yet)."""
    return _by_alias(tracking_uri, target_id, CHAMPION)


def challenger(tracking_uri: str, target_id: str) -> ModelVersionInfo | None:
    """The version under alias ``challenger`` (the last candidate; its tags carry ``decision`` and
    ``decision_reason``), or None."""
    return _by_alias(tracking_uri, target_id, CHALLENGER)


def _by_alias(tracking_uri: str, target_id: str, alias: str) -> ModelVersionInfo | None:
    c = _client(tracking_uri)
    try:
        mv = c.get_model_version_by_alias(model_name(target_id), alias)
    except MlflowException as e:
        if _not_found(e) or e.error_code == "INVALID_PARAMETER_VALUE":
            return None
        raise
    return ModelVersionInfo(version=str(mv.version), run_id=mv.run_id, source=mv.source, tags=dict(mv.tags))


def version_tags(tracking_uri: str, target_id: str, version: str) -> dict[str, str]:
    """The tags of ``version`` (e.g. its replayed ``acceptance_length``). Raises MlflowException."""
    return dict(_client(tracking_uri).get_model_version(model_name(target_id), str(version)).tags)


def tuned_k(tags: dict[str, str]) -> dict[str, int]:
    """profile → k from a version's tags: `live_tuned_k.<profile>` (tuned from the per-position
    acceptance a serving engine measured on live traffic) where present, else `tuned_k.<profile>`
    (the register step's, from the holdout replay)."""
    out = {k.removeprefix("tuned_k."): int(v) for k, v in tags.items() if k.startswith("tuned_k.")}
    return out | {k.removeprefix("live_tuned_k."): int(v) for k, v in tags.items() if k.startswith("live_tuned_k.")}


def replayed(tags: dict[str, str]) -> dict[str, list[float]]:
    """The first-token acceptance a version's evaluation replayed and the chains it counted (tag
    ``first_token_acceptance``, JSON {class: [a₁, chains]}, "" = overall; `engine.health`); {} when
    the tag is missing or malformed."""
    try:
        rep = json.loads(tags.get(FIRST_TOKEN_TAG, "{}"))
        return {str(k): [float(a), float(n)] for k, (a, n) in rep.items() if 0 <= float(a) <= 1 and 0 <= float(n) < math.inf}
    except (ValueError, TypeError, AttributeError):
        return {}


def _download_bundle(tracking_uri: str, source: str, run_id: str | None, dest: Path) -> Path:
    """The version at ``source`` (+ its run's ``sidecars/``) as a draft bundle at ``dest``, replacing
    what was there. A version logged before sidecars were split out has them inside ``draft/``:
    ``make_bundle`` moves them beside it either way."""
    import shutil

    import mlflow.artifacts  # local import: keeps module import light

    dest = Path(dest)
    tmp = dest.with_name(dest.name + ".dl")
    shutil.rmtree(tmp, ignore_errors=True)
    flat = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(tmp / "v"),
                                                    tracking_uri=tracking_uri))
    if run_id:
        for a in _client(tracking_uri).list_artifacts(run_id, SIDECAR_DIR):
            if not a.is_dir:
                got = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=a.path,
                                                          dst_path=str(tmp / "s"), tracking_uri=tracking_uri)
                shutil.move(got, flat / Path(a.path).name)
    shutil.rmtree(dest, ignore_errors=True)
    make_bundle(flat, dest)
    shutil.rmtree(tmp, ignore_errors=True)
    return dest


def download_champion(tracking_uri: str, target_id: str, dest: Path) -> Path | None:
    """Download the champion into ``dest/draft``: a draft bundle (``draft/`` for the engines,
    sidecars and ``version.json`` = {version, run_id, tuned_k}: what was evaluated, beside it).
    Returns that bundle dir, or None when there is no champion."""
    info = champion(tracking_uri, target_id)
    if info is None:
        return None
    local = _download_bundle(tracking_uri, info.source, info.run_id, Path(dest) / ARTIFACT_DIR)
    write_version(local, info.version, info.run_id, tuned_k(info.tags), replayed(info.tags))
    return local


def download_version(tracking_uri: str, target_id: str, ref: str, dest: Path) -> Path:
    """Download version ``ref`` (a number, or an alias such as ``champion``) into ``dest/v<N>`` as a
    draft bundle (with ``version.json``); returns it. Raises LookupError for an unknown version/alias."""
    c = _client(tracking_uri)
    name = model_name(target_id)
    try:
        v = _version(c, name, ref) if str(ref).strip().isdigit() else _alias_version(c, name, str(ref))
    except RegistryError as e:
        raise LookupError(str(e)) from None
    if v is None:
        raise LookupError(f"{name} has no alias {ref!r}")
    mv = c.get_model_version(name, v)
    local = _download_bundle(tracking_uri, mv.source, mv.run_id, Path(dest) / f"v{v}")
    write_version(local, v, mv.run_id, tuned_k(dict(mv.tags)), replayed(dict(mv.tags)))
    return local


def cycle_history(tracking_uri: str, target_id: str) -> list[dict]:
    """Every registered version of ``target_id``'s draft, oldest first: {version, run_id,
    acceptance_length, baseline_acceptance_length (champion τ on the same holdout, None for the
    first), decision (promoted / rejected / rolled_back / restored / None)}. From version tags,
    so it needs no run search."""
    c = _client(tracking_uri)
    name = model_name(target_id)
    try:
        mvs = c.search_model_versions(f"name = '{name}'")
    except MlflowException as e:
        if _not_found(e):
            return []
        raise
    out = []
    for mv in sorted(mvs, key=lambda m: int(m.version)):
        t = mv.tags
        tau, base = _float(t.get("acceptance_length")), _float(t.get("baseline_acceptance_length"))
        if tau is None:  # not a cycle's candidate (e.g. a bootstrap draft), or a hand-edited tag
            continue
        out.append({"version": str(mv.version), "run_id": mv.run_id, "acceptance_length": tau,
                    "baseline_acceptance_length": base, "decision": t.get("decision")})
    return out


def _float(x: str | None) -> float | None:
    try:
        v = float(x) if x is not None else None
    except ValueError:
        return None
    return v if v is not None and math.isfinite(v) else None


def find_version(tracking_uri: str, target_id: str, tags: dict[str, str]) -> ModelVersionInfo | None:
    """The newest version of ``target_id``'s draft whose tags include ``tags`` (e.g. the
    candidate's ``draft_sha256``: a retried register finds what it already logged), or None."""
    c = _client(tracking_uri)
    try:
        mvs = c.search_model_versions(f"name = '{model_name(target_id)}'")
    except MlflowException as e:
        if _not_found(e):
            return None
        raise
    hits = [m for m in mvs if all(m.tags.get(k) == v for k, v in tags.items())]
    if not hits:
        return None
    m = max(hits, key=lambda m: int(m.version))
    return ModelVersionInfo(version=str(m.version), run_id=m.run_id, source=m.source, tags=dict(m.tags))


def log_figures(tracking_uri: str, run_id: str, figures: dict) -> list[str]:
    """Log matplotlib figures as PNG artifacts ``plots/<name>.png`` of ``run_id`` (closing them).
    Returns the artifact paths."""
    import matplotlib.pyplot as plt
    c = _client(tracking_uri)
    paths = []
    for name, fig in figures.items():
        try:
            c.log_figure(run_id, fig, f"plots/{name}.png")
            paths.append(f"plots/{name}.png")
        finally:
            plt.close(fig)
    return paths


# ---------------------------------------------------------------- decisions


def promote_if_better(tracking_uri: str, target_id: str, version: str, candidate_tau: float,
                      champion_tau: float | None, min_relative_gain: float, lossless: bool,
                      evaluated_champion: str | None = None) -> Decision:
    """Promote ``version`` to ``champion`` iff ``lossless`` and (no champion yet or
    ``candidate_tau >= champion_tau * (1 + min_relative_gain)``); τ in tokens per target forward,
    both measured on the same holdout. ``evaluated_champion``: the champion version ``champion_tau``
    was measured on; when the alias has moved since (a manual promote/rollback during the cycle),
    the candidate is not promoted (it was not compared with the current champion). The decision is
    recorded (``_record``). MLflow aliases have no compare-and-set: two gates racing at the same
    instant can both pass; the tide-cycle deployment runs one cycle at a time.
    Raises RegistryError if a champion exists but ``champion_tau`` is None (evaluate it first).
    """
    c = _client(tracking_uri)
    name = model_name(target_id)
    version = _version(c, name, version)
    current = _alias_version(c, name, CHAMPION)
    if current is not None and champion_tau is None:
        raise RegistryError(f"{name}: champion v{current} exists but champion_tau is None; "
                            "evaluate the champion on the same holdout and pass its τ")
    if current == version:
        reason, ok = f"v{version} is already champion", False
    elif evaluated_champion is not None and current != str(evaluated_champion):
        reason, ok = (f"champion changed during the cycle (evaluated against v{evaluated_champion}, champion is now "
                      f"v{current}): not compared with the current champion, not promoted; run a new cycle"), False
    elif not lossless:
        reason, ok = "losslessness check failed: never promoted", False
    elif not math.isfinite(candidate_tau):
        reason, ok = f"candidate τ={candidate_tau} is not finite", False
    elif current is None:
        reason, ok = f"first champion (τ={candidate_tau:.4f})", True
    else:
        bar = champion_tau * (1 + min_relative_gain)
        ok = candidate_tau >= bar
        cmp = ">=" if ok else "<"
        reason = (f"τ {candidate_tau:.4f} {cmp} {bar:.4f} = champion v{current} τ {champion_tau:.4f} "
                  f"× (1 + {min_relative_gain:g})")
    if ok:
        _make_champion(c, name, version)
    d = Decision(promoted=ok, reason=reason, version=version, previous_champion=current)
    _record(c, name, version, "promoted" if ok else "rejected", reason)
    return d


def evaluation_problem(tags: dict[str, str]) -> str | None:
    """Why version tags do not show a passed evaluation (None: they do). An evaluated version
    carries what the cycle's register step writes after `evaluate`: tag ``lossless`` (``"True"``:
    speculative greedy outputs == the target's on the holdout) and tag ``acceptance_length`` (the
    candidate's measured τ, tokens per target forward, finite)."""
    lossless, tau = tags.get("lossless"), tags.get("acceptance_length")
    if lossless == "False":
        return "failed evaluation's losslessness check (its outputs differ from the target's): it is never promoted"
    if lossless != "True" or _float(tau) is None:
        have = ", ".join(f"{k}={tags[k]!r}" for k in ("lossless", "acceptance_length") if k in tags) or "neither"
        return (f"was never evaluated (needs tags lossless='True' and a finite acceptance_length; has {have}): "
                "it is not promoted blind")
    return None


def promote(tracking_uri: str, target_id: str, version: str, reason: str, *,
            allow_unevaluated: bool = False) -> Decision:
    """Make ``version`` champion by hand (no τ rule), recording ``reason``; the current champion
    is left as is (Decision with promoted=False, nothing recorded).

    Only an evaluated version is promoted (``evaluation_problem``: tags ``lossless="True"`` and a
    finite ``acceptance_length``, as the cycle's register step writes them).
    ``allow_unevaluated=True`` (bootstrap only: the first static draft, when no evaluation is
    possible yet) skips the "never evaluated" check and records ``unevaluated`` in the reason; a
    version tagged ``lossless=False`` is refused even then.
    Raises RegistryError when the version does not exist, failed the losslessness check, or was
    never evaluated (the message names the fix: pick an evaluated version, or run a cycle)."""
    c = _client(tracking_uri)
    name = model_name(target_id)
    version = _version(c, name, version)
    mv = c.get_model_version(name, version)
    if _alias_version(c, name, CHAMPION) == version:
        return Decision(promoted=False, reason=f"v{version} is already champion; nothing changed", version=version,
                        previous_champion=version)
    problem = evaluation_problem(dict(mv.tags))
    if problem and (mv.tags.get("lossless") == "False" or not allow_unevaluated):
        fix = ("fix the draft/engine and run a new cycle" if mv.tags.get("lossless") == "False" else
               "promote a version that a cycle evaluated and registered (its tags carry lossless and "
               "acceptance_length; see the versions in the MLflow UI), or run `tidespec cycle` to evaluate a candidate")
        raise RegistryError(f"{name} v{version} {problem}; {fix}")
    why = f"manual: {reason}" if not problem else f"manual, unevaluated (bootstrap): {reason}"
    prev = _make_champion(c, name, version)
    d = Decision(promoted=True, reason=why, version=version, previous_champion=prev)
    _record(c, name, version, "promoted", d.reason)
    return d


def rollback(tracking_uri: str, target_id: str, reason: str = "") -> Decision:
    """Move ``champion`` back to the previous champion in ``champion_history``; ``reason`` (why)
    is recorded with the decision.

    Returns a Decision about the restored version (``previous_champion`` = the demoted one, which
    gets ``decision=rolled_back``). Raises RegistryError when there is no previous champion.
    """
    c = _client(tracking_uri)
    name = model_name(target_id)
    current = _alias_version(c, name, CHAMPION)
    if current is None:
        raise RegistryError(f"{name}: no champion to roll back; promote a version first")
    hist = _history(c, name)
    while hist and (hist[-1] == current or not _exists(c, name, hist[-1])):  # deleted versions cannot come back
        hist.pop()
    if not hist:
        raise RegistryError(f"{name}: no earlier champion than v{current} (deleted versions skipped); nothing to "
                            "roll back to (use promote to pick a version by hand)")
    target = hist[-1]
    c.set_registered_model_alias(name, CHAMPION, target)
    _set_history(c, name, hist)
    why = f": {reason}" if reason else ""
    reason = f"rollback from v{current}{why}"
    _record(c, name, current, "rolled_back", f"rolled back to v{target}{why}")
    _record(c, name, target, "restored", reason)
    d = Decision(promoted=True, reason=reason, version=target, previous_champion=current)
    return d
