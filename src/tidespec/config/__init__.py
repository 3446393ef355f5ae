"""Configuration, the bottom layer: `params.yaml` as strict pydantic models (`params`: an unknown
key is an error naming it), the SageMaker sections (`sagemaker`), `tidespec serve`'s settings
(`serve_params`) and launch checks (`serve_launch`), and the strict base model (`strict`)."""
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
    SuffixParams,
    TargetParams,
    TrainParams,
    TreeParams,
    WorkloadParams,
    load_params,
    tree_num_draft_tokens,
)
from .serve_params import ServeParams

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
