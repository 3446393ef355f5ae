"""MLflow runs and registry versions of EAGLE3 drafts: names (experiment `tidespec/<target_id[:12]>`,
model `tidespec-draft-<target_id[:12]>`), candidates logged with their lineage tags, aliases
(`champion` serving, `challenger` the last candidate, `canary` a candidate the canary replicas serve
first), each replica's live counters on the version it serves, version tags (the tuned windows, the replayed
first-token acceptance). A version's `source` is the run's `draft/` artifact directory: exactly
config.json + model.safetensors, what vLLM and SGLang load; the rest of the checkpoint is the run's
`sidecars/`. Every function takes the tracking URI and its own MlflowClient; no global MLflow state.
More: docs/design/adapters.md.
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

from ...engine.spec_counters import SpecDecodeCounters
from ...engine.stats import per_position, tau_by_k
from ...errors import TidespecError
from ...workspace import CLASS_NAME, bundle_files, valid_tau_k

CHAMPION = "champion"
CHALLENGER = "challenger"
CANARY = "canary"
REPLICA_METRICS = "live/replica/"  # + <replica id>/<counter>: a replica's cumulative counters, `log_replica_counters`
REPLICA_STATE = ("requests", "capture_backlog", "last_seal")  # what a replica logs beside its counters each round
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


def utc(ms: float) -> str:
    """`ms` since the epoch as UTC ISO 8601, to the second (what the fleet's samples and windows show)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ms / 1000))


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
    ``draft/`` (config.json + model.safetensors) and ``sidecars/`` (every other file). Version tags = ``tags`` +
    ``target_id`` + the metrics ``acceptance_length`` and
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


def log_replica_counters(tracking_uri: str, target_id: str, version: str, replica_id: str,
                         counters: SpecDecodeCounters, at_ms: int | None = None,
                         state: dict[str, float] | None = None) -> None:
    """Log one replica's cumulative spec-decode counters of the version it serves to that version's run:
    metrics ``live/replica/<replica_id>/num_drafts``, ``.../num_draft_tokens``, ``.../num_accepted_tokens``
    and ``.../accepted/<i>`` (tokens accepted at draft position i, when counted), plus the replica's
    `state` this round under the same prefix (`REPLICA_STATE`: ``requests`` served since it started,
    ``capture_backlog`` tokens captured not yet sealed, ``last_seal`` its last seal, s since the epoch;
    each only when known), all at timestamp ``at_ms`` (ms since the epoch; default now) and step =
    drafts so far: one sample, which `replica_rows` reads back. Raises RegistryError for a version
    without a run, ValueError for a `state` key outside `REPLICA_STATE`, MlflowException on server
    errors."""
    unknown = sorted(set(state or {}) - set(REPLICA_STATE))
    if unknown:
        raise ValueError(f"replica state {unknown}: one of {', '.join(REPLICA_STATE)}")
    c = _client(tracking_uri)
    mv = c.get_model_version(model_name(target_id), str(version))
    if not mv.run_id:
        raise RegistryError(f"{model_name(target_id)} v{version} has no run to log live counters to")
    at = int(time.time() * 1000) if at_ms is None else int(at_ms)
    pre = f"{REPLICA_METRICS}{replica_id}/"
    values = {"num_drafts": counters.num_drafts, "num_draft_tokens": counters.num_draft_tokens,
              "num_accepted_tokens": counters.num_accepted_tokens}
    values |= {f"accepted/{i}": a for i, a in enumerate(counters.accepted_per_pos)} | (state or {})
    _log_batched(c, mv.run_id, metrics=[Metric(pre + k, float(v), at, counters.num_drafts) for k, v in values.items()])


def replica_rows(tracking_uri: str, run_id: str, since_ms: int = 0) -> dict[str, dict[int, dict[str, float]]]:
    """{replica id: {sample time (ms since the epoch): {name: value}}} of every sample logged to `run_id`
    at or after `since_ms` (`log_replica_counters`: counters and state under their names, e.g.
    ``num_drafts``, ``accepted/0``, ``requests``). Raises MlflowException on server errors."""
    c = _client(tracking_uri)
    rows: dict[str, dict[int, dict[str, float]]] = {}
    for key in c.get_run(run_id).data.metrics:
        if key.startswith(REPLICA_METRICS):
            replica, _, name = key[len(REPLICA_METRICS):].partition("/")
            for m in c.get_metric_history(run_id, key):
                if m.timestamp >= since_ms:
                    rows.setdefault(replica, {}).setdefault(m.timestamp, {})[name] = m.value
    return rows


def replica_counters(values: dict[str, float]) -> SpecDecodeCounters:
    """The cumulative counters of one sample's values (`replica_rows`; needs ``num_drafts``); the
    per-position counts only when positions 0..n-1 are all there."""
    pos = sorted(int(k.split("/")[1]) for k in values if k.startswith("accepted/"))
    per = tuple(int(values[f"accepted/{i}"]) for i in range(len(pos))) if pos == list(range(len(pos))) else ()
    return SpecDecodeCounters(int(values["num_drafts"]), int(values.get("num_draft_tokens", 0)),
                              int(values.get("num_accepted_tokens", 0)), per)


def champion_alias(workload: str = "") -> str:
    """The alias of the generalist's champion (``champion``, `workload` "") or of one workload
    class's (``champion-<class>``). Raises RegistryError for a class name outside ``[a-z0-9_-]``
    (64 at most, starting alphanumeric): MLflow aliases and directory names must hold it."""
    if not workload:
        return CHAMPION
    if not CLASS_NAME.match(workload):
        raise RegistryError(f"workload class {workload!r} cannot have a champion: use lower-case letters, "
                            "digits, '_' and '-' (at most 64, starting with a letter or digit)")
    return f"{CHAMPION}-{workload}"


def history_tag(workload: str = "") -> str:
    """The registered model's tag holding a champion alias's history (rollback's memory)."""
    return HISTORY_TAG if not workload else f"{HISTORY_TAG}.{workload}"


def champion(tracking_uri: str, target_id: str, workload: str = "") -> ModelVersionInfo | None:
    """The version under alias ``champion`` (the generalist), or ``champion-<workload>`` (that
    class's own); None when there is none (no model, or the class is served by the generalist)."""
    return _by_alias(tracking_uri, target_id, champion_alias(workload))


def aliases(tracking_uri: str, target_id: str) -> dict[str, str]:
    """{alias: version} of the target's registered model, every alias in one registry call ({} without a
    model). Raises MlflowException on other server errors."""
    try:
        got = _client(tracking_uri).get_registered_model(model_name(target_id)).aliases
    except MlflowException as e:
        if _not_found(e):
            return {}
        raise
    return {a: str(v) for a, v in got.items()}


def class_champions(tracking_uri: str, target_id: str, known: dict[str, str] | None = None) -> dict[str, str]:
    """{class: version} of every workload class with a champion of its own ({} without a model), from
    `known` (an `aliases` answer) when given, else from the registry."""
    pre = CHAMPION + "-"
    return {a[len(pre):]: v for a, v in (aliases(tracking_uri, target_id) if known is None else known).items()
            if a.startswith(pre) and CLASS_NAME.match(a[len(pre):])}


def canary(tracking_uri: str, target_id: str) -> ModelVersionInfo | None:
    """The version under alias ``canary`` (a candidate that passed the gate under ``deploy.rollout:
    canary``, served by the canary replicas until `adapters.registry.rollout` decides), or None."""
    return _by_alias(tracking_uri, target_id, CANARY)


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


def version_info(tracking_uri: str, target_id: str, version: str) -> ModelVersionInfo:
    """``version`` of ``target_id``'s draft: run id, source, tags. Raises MlflowException."""
    mv = _client(tracking_uri).get_model_version(model_name(target_id), str(version))
    return ModelVersionInfo(version=str(mv.version), run_id=mv.run_id, source=mv.source, tags=dict(mv.tags))


def version_tags(tracking_uri: str, target_id: str, version: str) -> dict[str, str]:
    """The tags of ``version`` (e.g. its replayed ``acceptance_length``). Raises MlflowException."""
    return version_info(tracking_uri, target_id, version).tags


def tuned_k(tags: dict[str, str]) -> dict[str, int]:
    """profile → k from a version's tags: `live_tuned_k.<profile>` (tuned from the per-position
    acceptance a serving engine measured on live traffic) where present, else `tuned_k.<profile>`
    (the register step's, from the holdout replay)."""
    out = {k.removeprefix("tuned_k."): int(v) for k, v in tags.items() if k.startswith("tuned_k.")}
    return out | {k.removeprefix("live_tuned_k."): int(v) for k, v in tags.items() if k.startswith("live_tuned_k.")}


def tau_k(tags: dict[str, str], run_metrics: dict[str, float] | None = None) -> list[float]:
    """The acceptance length a version's evaluation replayed at windows 0..K (tag ``tau_k``, JSON,
    written by the register step). A version registered before every version got that tag (only
    those registered with deploy.sagemaker had it) has it rebuilt from its run's per-position
    acceptance (``run_metrics``' ``accepted_per_pos/<i>``: τ(k) = 1 + Σ_{i<k}, `engine.stats.tau_by_k`).
    [] when neither is there or the result is not a chain's (`workspace.valid_tau_k`)."""
    try:
        out = json.loads(tags.get("tau_k", "[]"))
    except ValueError:
        out = []
    pp = per_position(run_metrics or {})
    if not out and pp and all(a >= b for a, b in zip(pp, pp[1:])):  # a chain's: never more often deeper
        out = tau_by_k(pp)
    return [float(t) for t in out] if valid_tau_k(out) else []


def version_tau_k(tracking_uri: str, tags: dict[str, str], run_id: str | None) -> list[float]:
    """`tau_k` of a version: its tag, else rebuilt from its run's metrics (one MLflow read, only then)."""
    out = tau_k(tags)
    if out or not run_id:
        return out
    try:
        return tau_k(tags, dict(_client(tracking_uri).get_run(run_id).data.metrics))
    except MlflowException:
        return []


def replayed(tags: dict[str, str]) -> dict[str, list[float]]:
    """The first-token acceptance a version's evaluation replayed and the chains it counted (tag
    ``first_token_acceptance``, JSON {class: [a₁, chains]}, "" = overall; `engine.health`); {} when
    the tag is missing or malformed."""
    try:
        rep = json.loads(tags.get(FIRST_TOKEN_TAG, "{}"))
        return {
            str(k): [float(a), float(n)] for k, (a, n) in rep.items() if 0 <= float(a) <= 1 and 0 <= float(n) < math.inf
        }
    except (ValueError, TypeError, AttributeError):
        return {}


# ---------------------------------------------------------------- decisions


