"""A serve-only install (`pip install 'tidespec[serve]'`) runs `tidespec serve`: the server starts and
answers in a python whose site-packages lacks the [mlops] and [aws] extras (Prefect, MLflow, DVC,
boto3, matplotlib), with the shipped params.yaml (pointed at the tiny target) and no MLflow in the
environment, as docs/serving.md runs it."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from conftest import shipped_params
from tidespec import assets

SRC = Path(__file__).resolve().parents[1] / "src"
# the [mlops] and [aws] extras' packages (and what only they pull in)
BLOCKED = ("prefect", "mlflow", "dvc", "boto3", "botocore", "s3transfer", "aiobotocore", "s3fs", "matplotlib",
           "moto")


def _serve_only_site(tmp: Path) -> Path:
    """A site-packages view without the blocked packages: a symlink to every other entry of this
    venv's site-packages (distributions' metadata included), as a serve-only install would have."""
    site = tmp / "site-packages"
    site.mkdir()
    (real,) = {Path(p) for p in sys.path if p.endswith("site-packages") and Path(p, "torch").exists()}
    for entry in real.iterdir():
        name = entry.name.lower().replace("-", "_")
        if not name.startswith(BLOCKED) and not name.endswith(".pth") and name != "__pycache__":
            (site / entry.name).symlink_to(entry)
    return site


def _child(tmp: Path, argv: list[str], **kw) -> subprocess.Popen:
    """`tidespec ARGV` in a python that sees only the serve-only site (-S: no .pth, no user site)."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp), "PYTHONPATH": f"{SRC}:{_serve_only_site(tmp)}"} | kw.pop(
        "env", {}
    )
    code = "import sys; from tidespec.cli import main; sys.argv = ['tidespec', *sys.argv[1:]]; main()"
    return subprocess.Popen([sys.executable, "-S", "-c", code, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_runs_without_mlops_packages(tmp_path, tiny_target_dir):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(shipped_params(tiny_target_dir)))
    port = _free_port()
    (tmp_path / "first").mkdir()
    refused = _child(tmp_path / "first", ["serve", "--root", str(tmp_path), "--params", str(tmp_path / "params.yaml")])
    out = refused.communicate(timeout=120)[0]  # capture publishes by default: that needs the MLOps side
    assert refused.returncode == 2 and "pip install 'tidespec[mlops]'" in out and "--no-publish" in out, out
    proc = _child(tmp_path, ["serve", "--root", str(tmp_path), "--params", str(tmp_path / "params.yaml"),
                             "--port", str(port), "--no-publish"], cwd=tmp_path,
                  env={"TIDESPEC_ADMIN_TOKEN": "change-me",  # the machine's calibration, as other tests share it
                       "TIDESPEC_CACHE": str(assets.cache_dir().resolve())})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300  # the suffix proposer (default) calibrates the policy's costs first
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert proc.poll() is None, proc.stdout.read()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 17, 33, 8], "max_tokens": 4}, timeout=60)
        assert r.status_code == 200 and len(r.json()["tidespec"]["token_ids"]) >= 1
        assert "tidespec:capture_written_total" in httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        proc.terminate()
        out = proc.communicate(timeout=60)[0]
    assert "Traceback" not in out, out
    assert "serve.auto_rollback: MLFLOW_TRACKING_URI is unset" in out, out  # shipped default: noted, not refused
    assert "no draft yet (target alone until one is deployed); proposers " in out, out
    assert f"k chosen per step up to {shipped_params(tiny_target_dir)['engine']['num_draft_tokens']} (goodput " in out


def test_the_serve_only_site_lacks_the_mlops_side(tmp_path):
    """Control: in the same child the MLOps side is really missing (so the test above proves something)."""
    proc = _child(tmp_path, ["cycle"], env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"})
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 2 and "pip install 'tidespec[mlops]'" in out and "Traceback" not in out, out
