"""Draft bundles and figures in MLflow: a registered version's draft directory downloaded (the champion's, or any
version's), the cycle history across versions, a version found by its tags, and plots logged to a run."""

from __future__ import annotations

import math
from pathlib import Path

from mlflow.exceptions import MlflowException

from ...workspace import make_bundle, write_version
from .client import (
    ARTIFACT_DIR,
    SIDECAR_DIR,
    ModelVersionInfo,
    RegistryError,
    _alias_version,
    _client,
    _not_found,
    _version,
    champion,
    model_name,
    replayed,
    tuned_k,
    version_tau_k,
)
from .client import canary as canary_version


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


def served_by(tracking_uri: str, target_id: str, workload: str = "", canary: bool = False) -> ModelVersionInfo | None:
    """The version a replica serves: the champion (``workload``: that class's own); for a canary
    replica (``canary``, the generalist) the ``canary`` alias while one exists. None: none."""
    return (canary_version(tracking_uri, target_id) if canary and not workload else None) or \
        champion(tracking_uri, target_id, workload)


def download_champion(tracking_uri: str, target_id: str, dest: Path, workload: str = "",
                      canary: bool = False) -> Path | None:
    """Download the champion (``workload``: that class's own; ``canary``: what a canary replica serves,
    `served_by`) into ``dest/draft``: a draft bundle
    (``draft/`` for the engines, sidecars and ``version.json`` = {version, run_id, tuned_k}: what was
    evaluated, beside it). Returns that bundle dir, or None when there is no such champion."""
    info = served_by(tracking_uri, target_id, workload, canary)
    if info is None:
        return None
    local = _download_bundle(tracking_uri, info.source, info.run_id, Path(dest) / ARTIFACT_DIR)
    write_version(local, info.version, info.run_id, tuned_k(info.tags), replayed(info.tags),
                  version_tau_k(tracking_uri, info.tags, info.run_id))
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
    write_version(local, v, mv.run_id, tuned_k(dict(mv.tags)), replayed(dict(mv.tags)),
                  version_tau_k(tracking_uri, dict(mv.tags), mv.run_id))
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


def find_version(tracking_uri: str, target_id: str, tags: dict[str, str],
                 workload: str | None = None) -> ModelVersionInfo | None:
    """The newest version of ``target_id``'s draft whose tags include ``tags`` (e.g. the
    candidate's ``draft_sha256``: a retried register finds what it already logged), and, with
    ``workload``, registered for that workload class ("" the generalist: no ``workload`` tag; two
    candidates trained on the same data have the same weights), or None."""
    c = _client(tracking_uri)
    try:
        mvs = c.search_model_versions(f"name = '{model_name(target_id)}'")
    except MlflowException as e:
        if _not_found(e):
            return None
        raise
    hits = [m for m in mvs if all(m.tags.get(k) == v for k, v in tags.items())
            and (workload is None or m.tags.get("workload", "") == workload)]
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
