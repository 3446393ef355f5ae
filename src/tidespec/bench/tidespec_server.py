"""`tidespec serve` (the embedded engine) as rows of `tidespec bench llama-server`: server against server.

A row is `tidespec serve --no-capture` started as a user starts it, in a workspace of its own (a
temporary root holding its params.yaml and, for a speculative row, the champion bundle under
data/drafts/champion), sharing the bench's asset cache (`TIDESPEC_CACHE`: the converted target and
the step-cost calibration are not redone per server). Rows per precision p (`methods.PRECISIONS`):
`tidespec_serve_<p>_no_spec` (no champion, the suffix proposer off: plain decoding) and
`tidespec_serve_<p>_default` (params.yaml as given at that precision with the champion: the draft and
the suffix proposer under the goodput policy). Requests: `/v1/completions` with token-id prompts,
greedy, the request's `workload` class named (the class the goodput policy keys on); τ from the
server's own `tidespec:spec_decode_*` counters.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from ..adapters.process import ServerProcess, free_port
from ..assets import cache_dir
from ..backends.base import metrics_text, parse_spec_decode
from ..config import Params
from ..config.serve_launch import API_KEY_ENV
from ..engine.spec_counters import SpecDecodeCounters
from .methods import at_precision

PREFIX = "tidespec:spec_decode_"
UNSET = ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")  # a bench's server reports to no registry, publishes no event
ROW_PREFIX = "tidespec_serve_"


@dataclass(frozen=True)
class ServeRow:
    """One `tidespec serve` row: its params (at the row's precision) and champion (None: no speculation)."""

    params: Params
    champion: Path | None
    precision: str

    def describe(self) -> dict:
        """What the report records of the row."""
        e = self.params.engine
        return {"precision": self.precision, "champion": str(self.champion) if self.champion else None,
                "suffix": e.suffix.enabled, "adaptive": e.adaptive, "num_draft_tokens": e.num_draft_tokens}

    @classmethod
    def rows(cls, params: Params, precisions: list[str], champion: Path) -> dict[str, ServeRow]:
        """`tidespec_serve_<p>_no_spec` and `..._default` for each precision (module docstring)."""
        out = {}
        for p in dict.fromkeys(precisions):
            at = at_precision(params, p)
            plain = at.model_copy(update={"engine": at.engine.model_copy(update={
                "suffix": at.engine.suffix.model_copy(update={"enabled": False})})})
            out[f"{ROW_PREFIX}{p}_no_spec"] = cls(plain, None, p)
            out[f"{ROW_PREFIX}{p}_default"] = cls(at, Path(champion), p)
        return out


class TidespecServer:
    """`tidespec serve` for one row, on a free port of 127.0.0.1 (`start`, `url`, `stop`), its torch
    threads `threads` (OMP_NUM_THREADS: the server sets none of its own). It never reports to the
    registry of the shell that runs the bench (MLFLOW_TRACKING_URI and PREFECT_API_URL left out);
    a `$TIDESPEC_API_KEY` it inherits, the bench's requests send."""

    def __init__(self, row: ServeRow, log: Path, threads: int):
        self.row, self.log, self.threads = row, Path(log), threads
        self.root = Path(tempfile.mkdtemp(prefix="tidespec-bench-serve-"))
        self.server: ServerProcess | None = None
        self.url = ""

    def start(self, timeout_s: float = 600) -> TidespecServer:
        """Write the workspace, start the server, wait for `/health`. Raises ProcessError with the
        log's tail when it exits or is not healthy within `timeout_s` s (nothing left running)."""
        (self.root / "params.yaml").write_text(yaml.safe_dump(self.row.params.model_dump(mode="json"), sort_keys=False))
        if self.row.champion is not None:
            shutil.copytree(self.row.champion, self.root / "data" / "drafts" / "champion")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "tidespec.cli", "serve", "--root", str(self.root), "--params",
               str(self.root / "params.yaml"), "--port", str(port), "--no-capture"]
        env = {"TIDESPEC_CACHE": str(cache_dir().resolve()), "OMP_NUM_THREADS": str(self.threads)}
        self.server = ServerProcess(cmd, "127.0.0.1", port, f"{self.url}/health", self.log, "tidespec serve",
                                    env=env, ready_timeout_s=timeout_s, unset=UNSET, cwd=self.root)
        try:
            self.server.start()
        except BaseException:
            shutil.rmtree(self.root, ignore_errors=True)
            raise
        return self

    def stop(self) -> None:
        """Stop the server's process group and remove its workspace."""
        if self.server is not None:
            self.server.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def complete(client: httpx.Client, url: str, ids: list[int], max_new: int, workload: str) -> list[int]:
    """One greedy `/v1/completions` of token-id prompt `ids`: the generated token ids (the response's
    `tidespec.token_ids`). Raises RuntimeError for a non-200 answer."""
    key = os.environ.get(API_KEY_ENV)
    r = client.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": max_new, "temperature": 0,
                                                    "workload": workload}, timeout=600,
                    headers={"Authorization": f"Bearer {key}"} if key else None)
    if r.status_code != 200:
        raise RuntimeError(f"tidespec serve at {url} answered {r.status_code}: {r.text[:300]}")
    return r.json()["choices"][0]["tidespec"]["token_ids"]


def scrape(url: str) -> SpecDecodeCounters | None:
    """The server's cumulative spec-decode counters (None before its first draft)."""
    return parse_spec_decode(metrics_text(url, "tidespec serve", RuntimeError), PREFIX)
