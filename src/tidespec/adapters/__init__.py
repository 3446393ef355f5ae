"""Adapters: one module per external system, above the data they move and below the steps.

`registry` (MLflow model registry), `versioning` (DVC), `orchestrate` (Prefect: deployments,
events, retries, loading the flows), `process` (the one process supervisor: launch, health, stop),
`services` (the local Prefect/MLflow/moto servers, on `process`), `aws` (boto3 clients, S3),
`sagemaker_train` (training jobs), `sagemaker_deploy` (endpoints, blue/green), `s3_capture`
(SageMaker Data Capture objects on S3), `publish` (a sealed snapshot → DVC + the Prefect event),
`sglang` (an SGLang server process and its HTTP API). docs/architecture.md has the layers.
"""
