#!/usr/bin/env bash
# Installs tidespec's acceptance publisher into a serving image (both Dockerfiles here run it):
# tidespec from /opt/tidespec without its own pins (the engine image keeps its torch), then what
# `python -m tidespec.backends.acceptance` imports; the import check fails the
# build, not the endpoint, when something is missing.
set -euo pipefail
pip install --no-cache-dir --no-deps /opt/tidespec
pip install --no-cache-dir boto3 prometheus-client pydantic typer rich pyyaml psutil zstandard safetensors httpx \
  filelock numpy
python3 -c "import tidespec.backends.acceptance, tidespec.backends.sglang.metrics, tidespec.backends.vllm.metrics"
