"""A llama.cpp `llama-server` (`make llama-server`) serving the target GGUF with a tidespec draft
converted to an EAGLE-3 GGUF (`LlamaCppLaunch`, `LlamaCppServer`), and whether it can run here
(`unavailable_reason`).

It runs `llama-server -m TARGET.gguf -md DRAFT.gguf --spec-type draft-eagle3 --spec-draft-n-max k
--metrics -np N -c N*CTX --host H --port P`. `--spec-type draft-eagle3` is required: with `-md`
alone llama.cpp loads the draft and drafts nothing, and when its speculative set-up fails it logs
the error and serves without speculation; so after `/health` the server's `/slots` must say
`"speculative": true` on every slot (`speculating`), or the start is refused. k is fixed per server:
llama.cpp compiles its per-request `speculative.*` fields out. The llama.cpp source facts it relies
on: docs/design/adapters.md, "llama.cpp".
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ...adapters import process
from ...errors import TidespecError, Unavailable
from ..base import EngineServer, default_threads
from .build import missing, server_binary, server_home

SPEC_TYPE = "draft-eagle3"
DEFAULT_CTX = 4096  # tokens per slot when engine.max_seq_len is null (the model's 8192 × slots: GBs of KV)


class LlamaCppUnavailable(Unavailable):
    """llama-server cannot run here (not built: `make llama-server`); the message names the fix."""


class LlamaCppError(TidespecError):
    """llama-server failed to start, died, did not speculate with its draft, or answered outside its contract."""


@dataclass(frozen=True)
class LlamaCppLaunch:
    """One llama-server. model_path: the target GGUF; draft_path: an EAGLE-3 draft GGUF
    (`convert.draft_gguf`) or None (plain decoding); num_speculative_tokens: k, drafted tokens per
    step (`--spec-draft-n-max`); parallel: slots, requests decoded together (`-np`); ctx_per_slot:
    tokens per request, prompt + completion (`-c` = parallel × this); threads: CPU threads (None:
    `$OMP_NUM_THREADS` as the embedded engine's torch takes it, else all cores); home: the `make
    llama-server` build (`build.server_home`); alias: the model name /v1/models shows."""

    model_path: str
    draft_path: str | None = None
    num_speculative_tokens: int = 3
    host: str = "127.0.0.1"
    port: int = 8200
    parallel: int = 4
    ctx_per_slot: int = DEFAULT_CTX
    threads: int | None = None
    alias: str | None = None
    home: str = field(default_factory=lambda: str(server_home()))
    extra_args: tuple[str, ...] = ()

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port}: must be 1..65535")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens {self.num_speculative_tokens}: >= 1 (no draft: draft_path None)")
        if self.parallel < 1 or self.ctx_per_slot < 16:
            raise ValueError(f"parallel {self.parallel} >= 1 and ctx_per_slot {self.ctx_per_slot} >= 16")

    @classmethod
    def from_params(cls, params, **overrides) -> LlamaCppLaunch:
        """The server params.yaml describes (`config.Params`): the target GGUF as shipped
        (`assets.target_gguf`; target.source smollm2 only, `config.serve_launch` refuses others),
        k = `engine.num_draft_tokens`, slots = `engine.max_batch`, ctx_per_slot = `engine.max_seq_len`
        (None: DEFAULT_CTX), a free port on `host` (127.0.0.1 unless overridden); `overrides`: any
        other field. Raises ValueError as the constructor."""
        from ...assets import target_gguf
        d, name = target_gguf()
        e = params.engine
        fields = {"model_path": str(d / name), "num_speculative_tokens": e.num_draft_tokens,
                  "parallel": e.max_batch, "ctx_per_slot": e.max_seq_len or DEFAULT_CTX} | overrides
        return cls(**{"port": process.free_port(fields.get("host", "127.0.0.1"))} | fields)

    @property
    def url(self) -> str:
        return process.base_url(self.host, self.port)


def launch_args(cfg: LlamaCppLaunch) -> list[str]:
    """The server's command line."""
    a = [str(server_binary(Path(cfg.home))), "-m", str(cfg.model_path), "--host", cfg.host, "--port", str(cfg.port),
         "-np", str(cfg.parallel), "-c", str(cfg.parallel * cfg.ctx_per_slot), "--metrics",
         "-t", str(cfg.threads or default_threads())]
    if cfg.alias:
        a += ["--alias", cfg.alias]
    if cfg.draft_path is not None:
        a += ["-md", str(cfg.draft_path), "--spec-type", SPEC_TYPE, "--spec-draft-n-max",
              str(cfg.num_speculative_tokens)]
    return a + list(cfg.extra_args)


def unavailable_reason(home: Path | None = None) -> str | None:
    """Why llama-server cannot run from build directory `home` (default `build.server_home()`), or
    None when it can."""
    home = Path(home) if home is not None else server_home()
    why = missing(home)
    if why is None and not os.access(server_binary(home), os.X_OK):
        why = f"{server_binary(home)} is not executable: run `make llama-server` again"
    return why


def slots(url: str, timeout_s: float = 10.0) -> list[dict]:
    """GET `<url>/slots`: one dict per slot (its `speculative` flag among them). Raises LlamaCppError."""
    try:
        r = httpx.get(f"{url}/slots", timeout=timeout_s)
    except httpx.HTTPError as e:
        raise LlamaCppError(f"llama-server at {url} did not answer /slots: {e}") from None
    if r.status_code != 200 or not isinstance(r.json(), list):
        raise LlamaCppError(f"llama-server at {url} answered /slots with {r.status_code}: {r.text[:300]}")
    return r.json()


def speculating(url: str) -> bool:
    """True iff every slot of the server at `url` speculates (llama.cpp's per-slot `speculative`)."""
    got = slots(url)
    return bool(got) and all(s.get("speculative") is True for s in got)


def request_refusal(body: dict) -> tuple[str, str] | None:
    """What the front door refuses before llama-server (`serve.frontdoor.build_frontdoor`'s `refuse`),
    as (the field, why), or None: `n` > 1 (llama.cpp copies a slot's KV cache to the extra choices but
    not the EAGLE-3 draft's state, and fails the request with HTTP 500 "failed to process speculative
    batch"; refused rather than split, so n choices are never n requests' worth of work unannounced),
    and a per-request draft length (`speculative.n_max` and its kin, which llama.cpp compiles out
    and would ignore)."""
    for key in ("n", "n_cmpl"):
        n = body.get(key)
        if isinstance(n, int) and not isinstance(n, bool) and n > 1:
            return key, (f"{key} = {n}: llama.cpp cannot serve several choices of one request with its EAGLE-3 draft "
                         f"(it fails them); send {n} requests with n = 1")
    spec = sorted(k for k in body if k == "speculative" or k.startswith("speculative."))
    if spec:
        return spec[0], (f"{spec[0]}: llama.cpp drafts a fixed length per server (its per-request speculative "
                         "fields are compiled out): remove it; the server drafts engine.num_draft_tokens")
    return None


class LlamaCppServer(EngineServer):
    """A running llama-server (context manager): `start()` checks the build and the files, launches
    it through the supervisor (`process.ServerProcess`: its own process group, log appended to
    `log_path`), waits for `/health`, and with a draft refuses a server that does not speculate;
    `stop()` stops the group (`backends.base.EngineServer`)."""

    def __init__(self, cfg: LlamaCppLaunch, log_path: Path, ready_timeout_s: float = 300.0, grace_s: float = 10.0):
        self.cfg, self.log_path = cfg, Path(log_path)
        self.server = process.ServerProcess(launch_args(cfg), cfg.host, cfg.port, f"{cfg.url}/health", self.log_path,
                                            "llama-server", error=LlamaCppError, ready_timeout_s=ready_timeout_s,
                                            grace_s=grace_s)

    def start(self) -> LlamaCppServer:
        """Raises LlamaCppUnavailable (with the fix); LlamaCppError (a missing GGUF, port in use,
        exited early, not healthy in time, with the log tail; a draft it does not speculate with)."""
        reason = unavailable_reason(Path(self.cfg.home))
        if reason:
            raise LlamaCppUnavailable(reason)
        for what, p in (("target", self.cfg.model_path), ("draft", self.cfg.draft_path)):
            if p is not None and not Path(p).is_file():
                raise LlamaCppError(f"{what} GGUF {p} does not exist")
        self.server.start()
        if self.cfg.draft_path is not None and not speculating(self.url):
            self.stop()
            raise LlamaCppError(f"llama-server loaded draft {self.cfg.draft_path} but its slots do not speculate "
                                f"(/slots speculative false): it would serve the target alone; see {self.log_path}:\n"
                                f"{process.log_tail(self.log_path)}")
        return self
