"""Configuration, the bottom layer: `params.yaml` as strict pydantic models (`params`: an unknown
key is an error naming it), the SageMaker sections (`sagemaker`), `tidespec serve`'s launch checks
(`serve_launch`), and the strict base model (`strict`)."""
from .params import (
    BootstrapParams,
    CaptureParams,
    CurateParams,
    DeployParams,
    DraftParams,
    EngineParams,
    EvaluateParams,
    IngestParams,
    Params,
    ServeParams,
    SuffixParams,
    TargetParams,
    TrainParams,
    TreeParams,
    WorkloadParams,
    load_params,
    tree_num_draft_tokens,
)

__all__ = [
    "BootstrapParams",
    "CaptureParams",
    "CurateParams",
    "DeployParams",
    "DraftParams",
    "EngineParams",
    "EvaluateParams",
    "IngestParams",
    "Params",
    "ServeParams",
    "SuffixParams",
    "TargetParams",
    "TrainParams",
    "TreeParams",
    "WorkloadParams",
    "load_params",
    "tree_num_draft_tokens",
]
