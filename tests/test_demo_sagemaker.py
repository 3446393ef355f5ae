"""`make demo-sagemaker` runs `tidespec demo --sagemaker`: that command, as typed, on the tiny target
(byte-level tokenizer, ChatML template; a small static bootstrap): it must finish (exit 0, τ before →
after printed) and stop the Prefect, MLflow and moto servers it started, whatever happened."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import tiny_params_yaml

pytestmark = pytest.mark.services
REPO = Path(__file__).resolve().parents[1]


def test_demo_sagemaker_command_finishes_and_stops_its_servers(tmp_path, tiny_tok_target_dir):
    from tidespec import assets
    from tidespec.adapters import services
    raw = yaml.safe_load(tiny_params_yaml(tiny_tok_target_dir))
    raw["engine"] |= {"max_seq_len": 512}  # the tiny target's context: HumanEval prompts that fit are served
    raw["train"] |= {"max_seq_len": 512}  # byte-level prompts are long: the responses must be inside the window
    raw["bootstrap"] = {"tokens": 1500, "conversations": 40, "max_tokens": 128}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    env = os.environ | {"TIDESPEC_CACHE": str(assets.cache_dir().resolve()), "PYTHONPATH": str(REPO / "src")}
    env = {k: v for k, v in env.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL")}
    p = subprocess.run([sys.executable, "-m", "tidespec.cli", "demo", "--sagemaker", "--root", str(tmp_path),
                        "--params", str(tmp_path / "params.yaml")], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=1200)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "τ " in out and " → " in out and "promoted=" in out, out[-4000:]
    state = tmp_path / ".tidespec" / "demo-sagemaker" / ".tidespec" / "services"
    assert services.recorded(state) == [] or not any(r["alive"] for r in services.status(state).values())
