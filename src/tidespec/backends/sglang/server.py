"""SGLang's server (CUDA only): launch arguments, the server process (through `process`), its
client, and capture from it.

SGLang pins its own torch, transformers and CUDA kernels, so it never shares tidespec's venv: it
runs as its own server (`<python> -m sglang.launch_server …`) and is spoken to over HTTP. Serving
uses `--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR` and SGLang's tree knobs;
capture runs target-only servers with `--enable-return-aux-hidden-states` (output-of-layer ids, as
tidespec's) or `--enable-return-hidden-states`. Without CUDA or the environment, `start()` raises
SGLangUnavailable naming the fix. The SGLang source facts it relies on: docs/design/adapters.md.
"""
from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch

from ...adapters import process
from ...errors import TidespecError, Unavailable

SGLANG_VERSION = "0.5.23"
VENV = ".venv-sglang"  # SGLang's own environment (its torch and CUDA kernels), on a GPU machine
CONDITIONAL_PLUS_ONE = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "Glm4MoeLiteForCausalLM",
                        "GptOssForCausalLM")
PROBE = ("import json, torch, sglang; print(json.dumps({'sglang': sglang.__version__, "
         "'cuda': torch.cuda.is_available()}))")


def default_python() -> str:
    """SGLang's interpreter when none is given: $TIDESPEC_SGLANG_PYTHON, else `.venv-sglang/bin/python`
    in the working directory."""
    return os.environ.get("TIDESPEC_SGLANG_PYTHON") or str(Path(VENV) / "bin" / "python")


class SGLangUnavailable(Unavailable):
    """SGLang cannot run here (no CUDA device, or no SGLang environment); the message names the fix."""


class SGLangError(TidespecError):
    """The SGLang server failed to start, died, or answered outside its contract."""


@dataclass(frozen=True)
class SGLangLaunch:
    """One SGLang server process. mode: `serve` (EAGLE3 with `draft_path`, or the target alone
    without it), `capture_aux` (target alone, returns aux hidden states `[T, 3H]`), `capture_last`
    (target alone, returns final hidden states `[T, H]`). aux_layer_ids: output-of-layer ids
    (tidespec/SpecForge convention), required for capture_aux. capture_max_len: the longest
    sequence a capture request may send (the chunked-prefill size, so prefill is one pass).
    served_model_name, context_length (tokens; None: the model's), max_running_requests (None:
    SGLang's): `--served-model-name`, `--context-length`, `--max-running-requests` of a serve server.
    dtype: SGLang's `--dtype` for target and draft (`auto` with a draft: the target's, `auto_dtype`;
    float32 needs an `--attention-backend` such as triton in extra_args)."""

    model_path: str
    mode: Literal["serve", "capture_aux", "capture_last"] = "serve"
    python: str = "python"
    host: str = "127.0.0.1"
    port: int = 30000
    tp_size: int = 1
    dtype: str = "auto"
    mem_fraction_static: float | None = None
    draft_path: str | None = None
    num_steps: int = 4
    eagle_topk: int = 1
    num_draft_tokens: int | None = None  # None: num_steps + 1 (chain) when topk is 1
    aux_layer_ids: tuple[int, ...] | None = None
    capture_max_len: int = 4096
    served_model_name: str | None = None
    context_length: int | None = None
    max_running_requests: int | None = None
    extra_args: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self):
        if self.mode not in ("serve", "capture_aux", "capture_last"):
            raise ValueError(f"mode {self.mode!r}: one of serve, capture_aux, capture_last")
        if not 0 < self.port < 65536 or self.tp_size < 1 or self.num_steps < 1 or self.eagle_topk < 1:
            raise ValueError("port must be 1..65535; tp_size, num_steps and eagle_topk >= 1")
        if self.num_draft_tokens is not None and self.num_draft_tokens < self.num_steps + 1:
            raise ValueError(f"num_draft_tokens {self.num_draft_tokens} < num_steps + 1 = {self.num_steps + 1}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static {self.mem_fraction_static} must be in (0, 1)")
        if self.capture_max_len < 2:
            raise ValueError("capture_max_len must be >= 2")
        for name in ("context_length", "max_running_requests"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} {v} must be >= 1")

    @property
    def url(self) -> str:
        return process.base_url(self.host, self.port)


def check_aux_ids(ids, num_layers: int, architecture: str = "LlamaForCausalLM") -> tuple[int, ...]:
    """Validate output-of-layer aux ids for SGLang's capture: distinct, ascending, 0 ≤ id < L-1 (the
    last layer's output is not capturable), first id 1 for the archs whose +1 is conditional.
    Returns them unchanged (SGLang applies the +1). Raises ValueError naming the fix."""
    if any(isinstance(i, bool) or int(i) != i for i in ids):
        raise ValueError(f"aux layer ids {tuple(ids)}: integers only")
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or list(ids) != sorted(set(ids)):
        raise ValueError(f"aux layer ids {ids}: need 3 distinct ascending ids (low, mid, high)")
    if ids[0] < 0 or ids[-1] >= num_layers - 1:
        raise ValueError(f"aux layer ids {ids}: SGLang captures outputs of layers 0..{num_layers - 2} "
                         f"(the last layer's output has no following layer); use e.g. "
                         f"[1, {num_layers // 2 - 1}, {num_layers - 4}]")
    if architecture in CONDITIONAL_PLUS_ONE and ids[0] != 1:
        raise ValueError(f"{architecture}: SGLang reads these ids as output-of-layer only when the first is 1; "
                         f"got {ids}")
    return ids


# float32 on SGLang: the triton attention backend (fa3, Hopper's default, takes fp16/bf16 only; `launch_args`)
SGLANG_FLOAT32_ARGS = ("--attention-backend", "triton")


def auto_dtype(model_path: str) -> str | None:
    """What SGLang 0.5.23's `--dtype auto` gives the model at `model_path`
    (`srt/configs/model_config.py::_get_and_verify_dtype`: its config's dtype; float32 or none →
    float16, bfloat16 for Gemma), or None when its config.json is not readable here (a hub id)."""
    try:
        d = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    c = d.get("text_config") if isinstance(d, dict) else None
    c = c if isinstance(c, dict) else d
    if not isinstance(c, dict):
        return None
    v = str(c.get("dtype") or c.get("torch_dtype") or d.get("dtype") or d.get("torch_dtype") or "float32")
    v = {"half": "float16", "float": "float32"}.get(v, v)
    if v in ("float16", "bfloat16"):
        return v
    return "bfloat16" if str(c.get("model_type", "")).startswith("gemma") else "float16"


def launch_args(cfg: SGLangLaunch) -> list[str]:
    """The full command line of the server process. dtype `auto` with a draft becomes the target's
    own (`auto_dtype`): SGLang 0.5.23 resolves `auto` for the draft from the draft's config.json
    (the draft worker gets the same server args: `srt/speculative/eagle_worker_v2.py`), so a float32
    draft config would run at float16 beside a bfloat16 target and fail on the dtype mismatch.
    Raises ValueError for an inconsistent config, and for dtype float32 without an
    `--attention-backend` in extra_args: SGLang picks fa3 on Hopper
    (`srt/arg_groups/model_override_base.py`), whose kernel (sglang-kernel 0.4.10 `flash_ops`)
    takes fp16, bf16 and fp8_e4m3 only."""
    backend = any(x == "--attention-backend" or x.startswith("--attention-backend=") for x in cfg.extra_args)
    if cfg.dtype in ("float32", "float") and not backend:
        raise ValueError(f"dtype {cfg.dtype}: SGLang's default attention kernel on Hopper (fa3) takes fp16/bf16 only; "
                         "pass extra_args=SGLANG_FLOAT32_ARGS (--attention-backend triton) or dtype 'bfloat16'")
    dtype = (auto_dtype(cfg.model_path) or "auto") if cfg.dtype == "auto" and cfg.draft_path else cfg.dtype
    a = [cfg.python, "-m", "sglang.launch_server", "--model-path", cfg.model_path, "--host", cfg.host,
         "--port", str(cfg.port), "--tp-size", str(cfg.tp_size), "--dtype", dtype]
    if cfg.mem_fraction_static is not None:
        a += ["--mem-fraction-static", f"{cfg.mem_fraction_static:g}"]
    if cfg.mode == "serve":
        a += ["--enable-metrics"]
        for flag, v in (("--served-model-name", cfg.served_model_name), ("--context-length", cfg.context_length),
                        ("--max-running-requests", cfg.max_running_requests)):
            if v is not None:
                a += [flag, str(v)]
        if cfg.draft_path:
            n = cfg.num_draft_tokens or (cfg.num_steps + 1 if cfg.eagle_topk == 1 else None)
            if n is None:
                raise ValueError("eagle_topk > 1 needs num_draft_tokens (the verify tree size)")
            if cfg.eagle_topk == 1 and n != cfg.num_steps + 1:
                raise ValueError(f"with eagle_topk 1 SGLang uses num_steps + 1 = {cfg.num_steps + 1} draft tokens, "
                                 f"not {n}")
            a += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", cfg.draft_path,
                  "--speculative-num-steps", str(cfg.num_steps), "--speculative-eagle-topk", str(cfg.eagle_topk),
                  "--speculative-num-draft-tokens", str(n)]
    else:
        if cfg.draft_path:
            raise ValueError("capture servers run the target alone: SGLang rejects a draft path with "
                             "--enable-return-aux-hidden-states")
        serve_only = [n for n in ("served_model_name", "context_length", "max_running_requests")
                      if getattr(cfg, n) is not None]
        if serve_only:
            raise ValueError(f"{', '.join(serve_only)}: settings of a serve server, not of a capture server")
        a += ["--disable-radix-cache", "--chunked-prefill-size", str(cfg.capture_max_len),
              "--context-length", str(cfg.capture_max_len + 8)]
        if cfg.mode == "capture_aux":
            if not cfg.aux_layer_ids:
                raise ValueError("capture_aux needs aux_layer_ids (output-of-layer ids, e.g. target.aux_layers)")
            ids = tuple(int(i) for i in cfg.aux_layer_ids)
            if list(ids) != sorted(set(ids)) or min(ids) < 0:
                raise ValueError(f"aux_layer_ids {ids}: distinct, ascending, >= 0 (check_aux_ids validates "
                                 "against the model)")
            a += ["--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
                  "--return-aux-hidden-state-layer-ids", *map(str, ids)]
        else:
            a += ["--enable-return-hidden-states"]
    return a + list(cfg.extra_args)


def unavailable_reason(python: str) -> str | None:
    """Why SGLang cannot run with interpreter `python`, or None when it can (SGLang importable, a
    CUDA device visible to that interpreter's torch; a usable answer is kept for the process:
    `process.probed`)."""
    return process.probed("sglang", python, _probe)


def _probe(python: str) -> str | None:
    fix = (f"install sglang>={SGLANG_VERSION} in its own environment (it pins torch 2.14.1 and CUDA kernels) and "
           "pass that environment's python; on CPU use `tidespec serve` (the embedded engine)")
    try:
        r = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=120)
    except (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, OSError) as e:
        return f"no usable Python at {python!r} ({type(e).__name__}): {fix}"
    except subprocess.TimeoutExpired:
        return f"{python} did not answer the SGLang probe within 120 s"
    if r.returncode != 0:
        return f"{python} cannot import sglang ({(r.stderr.strip().splitlines() or ['?'])[-1]}): {fix}"
    info = None
    for line in reversed(r.stdout.strip().splitlines()):
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if isinstance(d, dict) and "sglang" in d:
            info = d
            break
    if info is None:
        return f"{python} answered the SGLang probe without the expected JSON line: {r.stdout[-200:]!r}"
    if _version(str(info["sglang"])) < _version(SGLANG_VERSION):
        return (f"sglang {info['sglang']} is older than {SGLANG_VERSION} (the aux-hidden-state capture flags): "
                f"{fix}")
    if not info.get("cuda"):
        return ("SGLang needs a CUDA GPU (torch.cuda.is_available() is False here); on CPU use `tidespec serve` "
                "(the embedded engine)")
    return None


def _version(v: str):
    """PEP 440 version; an unparsable one sorts below every release."""
    from packaging.version import InvalidVersion, Version
    try:
        return Version(v)
    except InvalidVersion:
        return Version("0")


class SGLangServer:
    """A running SGLang server (context manager): `start()` probes availability, launches the process
    through the supervisor (`process.ServerProcess`: its own process group, log appended to
    `log_path`), waits for /health_generate; `stop()` SIGTERMs the group, SIGKILL after `grace_s`."""

    def __init__(self, cfg: SGLangLaunch, log_path: Path, ready_timeout_s: float = 900.0, grace_s: float = 30.0):
        self.cfg, self.log_path = cfg, Path(log_path)
        # a 1-token generate: slow on a cold GPU, hence the long probe
        self.server = process.ServerProcess(launch_args(cfg), cfg.host, cfg.port, f"{cfg.url}/health_generate",
                                            self.log_path, "SGLang server", error=SGLangError,
                                            ready_timeout_s=ready_timeout_s, grace_s=grace_s, probe_timeout_s=30.0)

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.server.proc

    def start(self) -> SGLangServer:
        """Raises SGLangUnavailable (with the fix), SGLangError (port in use, exited early, not ready
        in time; with the log tail)."""
        reason = unavailable_reason(self.cfg.python)
        if reason:
            raise SGLangUnavailable(reason)
        self.server.start()
        return self

    def stop(self) -> None:
        """SIGTERM the whole process group (its workers too, even when the main process already
        exited), SIGKILL what is left after `grace_s`."""
        self.server.stop()

    def __enter__(self) -> SGLangServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


# -- client -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SGLangResult:
    """One /generate answer: output_ids `[n]`, meta_info as returned, spec stats when present
    (`spec_verify_ct` verify steps, `spec_accept_length` τ)."""

    output_ids: list[int]
    meta_info: dict

    @property
    def acceptance_length(self) -> float | None:
        v = self.meta_info.get("spec_accept_length")
        return None if v is None else float(v)


def generate(url: str, input_ids: list[int], max_new_tokens: int, return_hidden_states: bool = False,
             timeout_s: float = 600.0, client=None) -> SGLangResult:
    """Greedy `/generate` on token ids. Raises SGLangError on a non-200 or a reply without output_ids."""
    import httpx
    body = {"input_ids": list(map(int, input_ids)),
            "sampling_params": {"max_new_tokens": int(max_new_tokens), "temperature": 0.0},
            "return_hidden_states": bool(return_hidden_states)}
    post = (client or httpx).post
    r = post(f"{url.rstrip('/')}/generate", json=body, timeout=timeout_s)
    if r.status_code != 200:
        raise SGLangError(f"SGLang /generate {r.status_code}: {r.text[:300]}")
    try:
        d = r.json()
        d = d[0] if isinstance(d, list) else d
        return SGLangResult([int(t) for t in d["output_ids"]], dict(d["meta_info"]))
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise SGLangError(f"SGLang /generate reply outside its contract ({type(e).__name__}: {e}): "
                          f"{r.text[:200]!r}") from None


def prefill_rows(meta_info: dict, n_tokens: int, width: int) -> torch.Tensor:
    """The prefill block of `meta_info.hidden_states` as `[n_tokens, width]` fp32. Raises SGLangError
    when it is missing or has another shape (radix-cache hit or chunked prefill: the fix is named)."""
    hs = meta_info.get("hidden_states")
    if not hs:
        raise SGLangError("no hidden_states in the reply: the capture server needs --enable-return-aux-hidden-"
                          "states / --enable-return-hidden-states and the request return_hidden_states=true")
    try:
        block = torch.tensor(hs[0], dtype=torch.float32)
    except (ValueError, TypeError) as e:
        raise SGLangError(f"hidden_states[0] is not a [rows, width] array of numbers: {e}") from None
    if block.dim() == 1:
        block = block.unsqueeze(0)
    if tuple(block.shape) != (n_tokens, width):
        raise SGLangError(f"prefill hidden states {tuple(block.shape)}, expected ({n_tokens}, {width}): launch the "
                          "capture server with --disable-radix-cache and --chunked-prefill-size >= the sequence "
                          "length (SGLangLaunch capture modes do)")
    if not torch.isfinite(block).all():
        raise SGLangError("hidden states contain NaN/Inf; refusing to capture them")
    return block


def capture_record(aux_url: str, last_url: str, input_ids: list[int], loss_mask: list[int], hidden_size: int,
                   client=None) -> dict[str, torch.Tensor]:
    """A capture record (store.FIELDS) for one served sequence (prompt + completion ids) from the two
    target-only capture servers: aux `[T, 3H]` and final `[T, H]` hidden states, bf16. Raises
    SGLangError (shapes), ValueError (mask length)."""
    T = len(input_ids)
    if len(loss_mask) != T:
        raise ValueError(f"loss_mask has {len(loss_mask)} entries for {T} tokens")
    aux = prefill_rows(generate(aux_url, input_ids, 1, True, client=client).meta_info, T, 3 * hidden_size)
    last = prefill_rows(generate(last_url, input_ids, 1, True, client=client).meta_info, T, hidden_size)
    return {"input_ids": torch.tensor(input_ids, dtype=torch.int32),
            "loss_mask": torch.tensor(loss_mask, dtype=torch.uint8),
            "aux_hidden_states": aux.to(torch.bfloat16), "hidden_states": last.to(torch.bfloat16)}


def serve_and_capture(serve_url: str, aux_url: str, last_url: str, prompt_ids: list[int], max_new_tokens: int,
                      hidden_size: int, client=None) -> tuple[SGLangResult, dict[str, torch.Tensor]]:
    """Serve one prompt on the EAGLE3 server, then capture its sequence: (the serving result with its
    τ, the capture record) — for `CaptureWriter.submit`. Same layout as the embedded engine's
    records: input_ids = prompt + completion[:-1] (the last token was never fed to the target), loss
    mask 1 on the completion positions."""
    res = generate(serve_url, prompt_ids, max_new_tokens, client=client)
    if not res.output_ids:
        raise SGLangError("SGLang returned no tokens; nothing to capture")
    seq = list(prompt_ids) + res.output_ids[:-1]
    mask = [0] * len(prompt_ids) + [1] * (len(res.output_ids) - 1)
    return res, capture_record(aux_url, last_url, seq, mask, hidden_size, client=client)


def submit_capture(writer, res: SGLangResult, record: dict[str, torch.Tensor], request_id: str,
                   workload: str = "default") -> bool:
    """Hand a `serve_and_capture` result to a `CaptureWriter` (same snapshots as the embedded engine):
    serving-time τ from SGLang's `spec_accept_length` (1.0 without speculation), acceptance rate from
    `spec_accept_rate` when given. Returns what `CaptureWriter.submit` returns."""
    rate = res.meta_info.get("spec_accept_rate")
    return writer.submit(record, request_id=request_id, workload=workload,
                         acceptance_length=res.acceptance_length or 1.0,
                         acceptance_rate=None if rate is None else float(rate))
