"""`tidespec serve`'s flags, checked with the params they run with, before anything starts.

A setting the chosen backend cannot honour is refused with the key or flag and the fix; a default
it runs without is only noted. "Set" means "differs from its default" (`Strict.changed`): the
shipped params.yaml writes out every default, and a default must never make a documented command
fail.
"""
from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, field_validator, model_validator

from .params import Params
from .strict import Strict

MLFLOW_ENV = "MLFLOW_TRACKING_URI"
API_KEY_ENV = "TIDESPEC_API_KEY"  # the key of the OpenAI routes (`--api-key` overrides it)
ADMIN_TOKEN_ENV = "TIDESPEC_ADMIN_TOKEN"  # the bearer token of /admin (`serve.admin`)
VLLM_API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own; the vLLM tidespec starts runs on loopback without a key
LLAMA_ENV = ("LLAMA_API_KEY", "LLAMA_ARG_")  # llama-server reads its settings from these too (one key, a prefix)
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "llama-cpp": "llama.cpp"}
LOOPBACK = ("127.0.0.1", "localhost", "::1")
EMBEDDED_ONLY = ("health_check_s", "classify_workload", "workload_by_model")
# serve.* keys a front door forwards past: the backend's own limits and defaults apply (set them there)
FRONTDOOR_UNUSED = ("max_queue", "max_tokens", "default_temperature")
# keys of a server tidespec starts and swaps; an SGLang server at --sglang-url is the user's own
ATTACHED_UNUSED = ("served_model_name", "watch_champion_s", "auto_rollback", "live_stats_s", "champion_source",
                   "canary")


class ServeLaunch(Strict):
    """The flags of `tidespec serve` (None: the params' value). backend: embedded (this process's
    engine) | vllm (a vLLM server this command starts, behind the OpenAI front door) | sglang (an
    SGLang server this command starts with `sglang_python`, or, with `sglang_url`, the user's own
    server, which tidespec neither swaps nor watches); vllm_python: vLLM's interpreter;
    capture / publish: capture finished requests, publish sealed snapshots; max_queue,
    request_timeout_s (s), max_tokens: the embedded engine's admission limits; llama-cpp: a
    llama.cpp `llama-server` (`make llama-server`) this command starts with the target GGUF and the
    champion converted to an EAGLE-3 GGUF, behind the same front door; api_key: the key of
    the OpenAI routes (None: `$TIDESPEC_API_KEY`, see `api_key_in`). Raises ValueError in one line
    naming the flag (`labels`) for a bad value (an empty key among them) or a flag of another
    backend."""

    labels = {"sglang_url": "--sglang-url", "sglang_python": "--sglang-python", "vllm_python": "--vllm-python",
              "max_queue": "--max-queue", "api_key": "--api-key",
              "request_timeout_s": "--timeout-s", "max_tokens": "--max-tokens", "backend": "--backend"}

    backend: Literal["embedded", "vllm", "sglang", "llama-cpp"] = "embedded"
    sglang_url: str | None = Field(None, pattern=r"^https?://")
    sglang_python: str | None = Field(None, min_length=1)
    vllm_python: str | None = Field(None, min_length=1)
    capture: bool = True
    publish: bool = True
    max_queue: int | None = Field(None, ge=1)
    request_timeout_s: float | None = Field(None, gt=0, allow_inf_nan=False)
    max_tokens: int | None = Field(None, ge=1)
    api_key: SecretStr | None = None

    @field_validator("api_key", mode="before")
    @classmethod
    def _a_key(cls, v):
        wrong = None if v is None else _key_problem(v.get_secret_value() if isinstance(v, SecretStr) else str(v))
        if wrong:
            raise ValueError(f"the key {wrong}: pass the key clients send as `Authorization: Bearer <key>` (or set "
                             f"{API_KEY_ENV}, which a process list does not show), or leave it out")
        return v

    def api_key_in(self, env: Mapping[str, str]) -> str | None:
        """The key of the OpenAI routes: --api-key, else `$TIDESPEC_API_KEY` in `env`, else None (the
        routes are open, as before). Raises ValueError for a `$TIDESPEC_API_KEY` set but empty (a key
        meant but lost is never served open) or with spaces around it (no client could send it)."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        key = env.get(API_KEY_ENV)
        wrong = None if key is None else _key_problem(key)
        if wrong:
            raise ValueError(f"{API_KEY_ENV} {wrong}: set it to the key clients send as `Authorization: Bearer "
                             "<key>`, or unset it to serve the OpenAI routes without a key")
        return key

    @field_validator("sglang_url")
    @classmethod
    def _a_server_url(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = urlsplit(v)
        if not parts.hostname:
            raise ValueError(f"{v!r} names no host: pass the SGLang server's http://HOST:PORT")
        try:
            parts.port  # noqa: B018 (urllib checks the port when it is read)
        except ValueError as e:
            raise ValueError(f"{v!r}: {e}: pass the SGLang server's http://HOST:PORT") from None
        return v

    @model_validator(mode="after")
    def _flags_of_the_backend(self):
        if self.sglang_url is not None and self.backend != "sglang":
            raise ValueError("--sglang-url goes with --backend sglang (and only with it)")
        if self.sglang_python is not None and (self.backend != "sglang" or self.sglang_url is not None):
            raise ValueError("--sglang-python goes with --backend sglang without --sglang-url (tidespec starts "
                             "SGLang with it; a server at --sglang-url runs in its own environment)")
        if self.vllm_python is not None and self.backend != "vllm":
            raise ValueError("--vllm-python goes with --backend vllm (and only with it)")
        for flag, v in (("--max-queue", self.max_queue), ("--max-tokens", self.max_tokens)):
            if v is not None and self.backend != "embedded":
                raise ValueError(f"{flag} applies to the embedded engine; --backend {self.backend} has its own limits")
        return self

    def check(self, p: Params, env: Mapping[str, str]) -> list[str]:
        """Check the params against this launch: raises ValueError naming the key and the fix for a
        setting the backend cannot honour; returns notes (one line each) on defaults it runs
        without. `env`: the process environment (MLFLOW_TRACKING_URI decides whether a rollback can
        reach the registry; `serve.champion_source: registry` is refused without it; the API key
        and the admin token are checked by `_keys`)."""
        s, notes = p.serve, self._keys(p, env)
        follows = self.backend == "embedded" or self.launches  # a server at --sglang-url is refused below
        if s.champion_source == "registry" and follows and not env.get(MLFLOW_ENV):
            raise ValueError(f"serve.champion_source: registry follows the MLflow registry's champion and "
                             f"{MLFLOW_ENV} is unset: set it to the registry's URL (`tidespec services up` on the "
                             "loop's machine prints it), or set serve.champion_source: directory (the champion the "
                             "cycle deploys to data/drafts on this machine)")
        if self.capture and p.capture.max_acceptance_rate is not None and (
                self.backend != "embedded" or p.capture.mode == "text"):
            raise ValueError("capture.max_acceptance_rate filters hidden-state capture (the embedded engine, "
                             "capture.mode: hidden); text capture has no acceptance: remove it")
        if self.backend == "embedded":
            if s.auto_rollback and not env.get(MLFLOW_ENV):
                notes.append(f"serve.auto_rollback: {MLFLOW_ENV} is unset, so the draft-health guard reports a "
                             "worse draft without rolling it back (set it to roll back through the registry)")
            if s.changed("live_stats_s") and s.live_stats_s > 0 and not env.get(MLFLOW_ENV):
                notes.append(f"serve.live_stats_s: {MLFLOW_ENV} is unset, so this replica's live counters are "
                             "logged nowhere (set it to log them to the served version's run)")
            return notes
        if self.backend == "llama-cpp":
            _gguf_as_shipped(p)
        elif p.target.quantization != "none":
            raise ValueError(f"target.quantization {p.target.quantization} is the embedded engine's CPU kernels; "
                             f"--backend {self.backend} runs the target with its own: set target.quantization: none "
                             f"(and serve a quantized checkpoint with {self.backend}'s --quantization)")
        if self.capture and p.capture.mode != "text":  # "hidden" is the default: nothing a user asked for
            notes.append(f"--backend {self.backend} captures request/response text (capture.mode: text): a front "
                         "door sees no hidden states; `tidespec ingest` rehydrates them")
        self._unused(p)
        notes.append(f"requests are forwarded as sent: one without temperature gets --backend {self.backend}'s "
                     "default (serve.default_temperature is the embedded engine's)")
        if self.launches:
            if s.live_stats_s > 0 and not env.get(MLFLOW_ENV):
                notes.append(f"serve.live_stats_s: {MLFLOW_ENV} is unset, so {self.backend}'s live counters are "
                             "logged nowhere and live τ rolls nothing back (set it to use the registry)")
            notes += self._started_engine(p)
        return notes

    def _keys(self, p: Params, env: Mapping[str, str]) -> list[str]:
        """The API key against the params and the environment: `serve.auth_health_metrics` without a
        key, the admin token's value as the key (a client of the OpenAI routes could swap drafts)
        and `$VLLM_API_KEY` before the vLLM tidespec starts (the front door checks the key, vLLM stays
        on loopback without one) are refused; a key before your own SGLang not on loopback is
        noted. Returns the notes."""
        key = self.api_key_in(env)
        if p.serve.auth_health_metrics and key is None:
            raise ValueError(f"serve.auth_health_metrics guards /health and /metrics with the API key, and no key is "
                             f"set: set {API_KEY_ENV} (or --api-key), or set serve.auth_health_metrics: false")
        admin = env.get(ADMIN_TOKEN_ENV)
        if key is not None and admin and hmac.compare_digest(key.encode(), admin.encode()):
            raise ValueError(f"the API key equals {ADMIN_TOKEN_ENV}: a client of the OpenAI routes could then swap "
                             "drafts; use two different secrets")
        llama = sorted(k for k in env if k == LLAMA_ENV[0] or k.startswith(LLAMA_ENV[1]))
        if self.backend == "llama-cpp" and llama:
            raise ValueError(f"{', '.join(llama)} set: the llama-server tidespec starts would read it, yet it listens "
                             "on 127.0.0.1 behind the front door (which checks the key) with its settings from "
                             f"params.yaml; unset it (the key: set {API_KEY_ENV} or --api-key instead)")
        if self.backend == "vllm" and env.get(VLLM_API_KEY_ENV):
            raise ValueError(f"{VLLM_API_KEY_ENV} is set: the vLLM server tidespec starts listens on 127.0.0.1 behind "
                             f"the front door, which checks the key itself; unset {VLLM_API_KEY_ENV} and set "
                             f"{API_KEY_ENV} (or --api-key) to the key instead")
        if key is not None and self.sglang_url is not None and urlsplit(self.sglang_url).hostname not in LOOPBACK:
            return [f"--sglang-url {self.sglang_url}: the front door checks the API key and forwards to your SGLang "
                    "without it; keep that server on loopback or a private network (docs/fleet.md)"]
        return []

    @property
    def launches(self) -> bool:
        """True when this command starts the engine server (vLLM, llama.cpp; SGLang without --sglang-url)."""
        return self.backend in ("vllm", "llama-cpp") or (self.backend == "sglang" and self.sglang_url is None)

    def _unused(self, p: Params) -> None:
        """Refuses serve.* keys set (changed from their default) that this front door does not use."""
        def keys(wrong: list[str]) -> tuple[str, tuple[str, str]]:  # ("serve.a, serve.b", (pronoun, default))
            one = len(wrong) == 1
            return f"serve.{', serve.'.join(wrong)}", ("it", "its default") if one else ("them", "their defaults")
        wrong = p.serve.changed(*EMBEDDED_ONLY)
        if wrong:
            named, (it, default) = keys(wrong)
            raise ValueError(f"{named}: the embedded engine's (draft health, workload classes); --backend "
                             f"{self.backend} does not use {it}: remove {it} or set {default}")
        wrong = p.serve.changed(*FRONTDOOR_UNUSED)
        if wrong:
            named, (it, default) = keys(wrong)
            raise ValueError(f"{named}: --backend {self.backend} does not use {it} (the front door forwards requests "
                             f"as sent; set the limit on the {self.backend} server): remove {it} or set {default}")
        wrong = [] if self.launches else p.serve.changed(*ATTACHED_UNUSED)
        if wrong:
            named, (it, default) = keys(wrong)
            raise ValueError(f"{named}: --backend sglang at --sglang-url is your own server, not one tidespec starts "
                             f"and swaps (drop --sglang-url to have tidespec start and swap one): remove {it} or set "
                             f"{default}")

    def _started_engine(self, p: Params) -> list[str]:
        """What the engine server tidespec starts takes from engine.*: vLLM and llama.cpp run EAGLE3
        chains (trees refused), SGLang chains or trees (engine.tree, validated with the params), all
        at k = engine.num_draft_tokens; the goodput policy and the suffix proposer are the embedded
        engine's (noted; llama.cpp's own n-gram proposers are not offered)."""
        e, notes, name = p.engine, [], ENGINE_NAMES[self.backend]
        if self.backend in ("vllm", "llama-cpp") and e.tree.eagle_topk > 1:
            raise ValueError(f"--backend {self.backend} runs EAGLE3 chains: engine.tree.eagle_topk > 1 applies to the "
                             "embedded engine; set it to 1")
        if self.backend == "llama-cpp":
            notes += _llama_cpp_notes(p)
        if self.backend == "sglang" and p.target.dtype == "float32":
            notes.append("SGLang runs target.dtype float32 with its triton attention backend (its default on Hopper, "
                         "fa3, takes fp16/bf16 only); GPU serving usually sets target.dtype: bfloat16")
        if e.suffix.enabled:
            notes.append(f"{name} drafts with the EAGLE3 draft only (engine.suffix, the suffix proposer and the "
                         "hybrid, is the embedded engine's)")
        if e.adaptive:
            notes.append(f"{name} drafts a fixed k = engine.num_draft_tokens = {e.num_draft_tokens} (engine.adaptive, "
                         "the goodput policy, is the embedded engine's)")
        return notes


def _gguf_as_shipped(p: Params) -> None:
    """llama.cpp serves the target GGUF as shipped (SmolLM2-135M-Instruct Q4_1, its own kernels):
    refuses another target.source, target.quantization or target.dtype, naming the key."""
    t = p.target
    if t.source != "smollm2":
        raise ValueError(f"target.source {t.source!r}: --backend llama-cpp serves the shipped target GGUF (smollm2, "
                         "SmolLM2-135M-Instruct Q4_1); set target.source: smollm2, or serve this target with "
                         "--backend vllm")
    for key, v in (("quantization", t.quantization), ("dtype", t.dtype), ("device", t.device)):
        if t.changed(key):
            raise ValueError(f"target.{key} {v}: --backend llama-cpp runs the target GGUF as shipped on the CPU (Q4_1 "
                             f"weights, llama.cpp's kernels); remove target.{key} or set it to its default")


def _llama_cpp_notes(p: Params) -> list[str]:
    """What llama.cpp's server does with what `tidespec serve` gives it."""
    e = p.engine
    ctx = f"engine.max_seq_len = {e.max_seq_len}" if e.max_seq_len else \
        "4096 (engine.max_seq_len is null; set it to change this)"
    return [f"llama-server decodes engine.max_batch = {e.max_batch} requests at once, each up to {ctx} tokens",
            "llama.cpp fixes k per server (its per-request speculative.* fields are compiled out) and answers n > 1 "
            "with EAGLE-3 by failing: the front door refuses both with 400"]


def _key_problem(key: str) -> str | None:
    """What makes `key` unusable as an API key (empty; spaces around it, which a bearer header
    cannot carry), or None."""
    if not key.strip():
        return "is empty"
    return "has spaces around it" if key != key.strip() else None
