"""The MLflow adapter: experiments, runs and the model registry for drafts (`client`: runs, versions, aliases, tags), their bundles and figures (`artifacts`), and the promotion decisions (`decisions`). Names follow the registry contract: experiment `tidespec/<target_id>`, model `tidespec-draft-<short id>`, aliases `champion` / `challenger`."""
from .client import (
    ARTIFACT_DIR,
    CHALLENGER,
    CHAMPION,
    FIRST_TOKEN_TAG,
    HISTORY_MAX,
    HISTORY_TAG,
    ModelVersionInfo,
    RegistryError,
    SIDECAR_DIR,
    VERSION_TAG_KEYS,
    challenger,
    champion,
    ensure_experiment,
    ensure_registered_model,
    experiment_name,
    log_candidate,
    log_live,
    model_name,
    replayed,
    tuned_k,
    version_tags,
)
from .artifacts import (
    cycle_history,
    download_champion,
    download_version,
    find_version,
    log_figures,
)
from .decisions import (
    Decision,
    decisions,
    evaluation_problem,
    promote,
    promote_if_better,
    rollback,
)

__all__ = ["ARTIFACT_DIR", "CHALLENGER", "CHAMPION", "Decision", "FIRST_TOKEN_TAG", "HISTORY_MAX", "HISTORY_TAG", "ModelVersionInfo", "RegistryError", "SIDECAR_DIR", "VERSION_TAG_KEYS", "challenger", "champion", "cycle_history", "decisions", "download_champion", "download_version", "ensure_experiment", "ensure_registered_model", "evaluation_problem", "experiment_name", "find_version", "log_candidate", "log_figures", "log_live", "model_name", "promote", "promote_if_better", "replayed", "rollback", "tuned_k", "version_tags"]
