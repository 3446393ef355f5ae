"""`tidespec bench llama-server`: llama.cpp's server with and without speculation, at c closed-loop clients.

llama.cpp's own server (`make llama-server`) on the shipped target GGUF, at the concurrency levels
its parallel slots serve. Rows:
`llama_cpp_server_no_spec`; `llama_cpp_server_eagle3_static` and `..._eagle3_adapted`, the tidespec
drafts converted to EAGLE-3 GGUFs (`backends.llama_cpp.draft_gguf`, f32 as `serve` converts them;
each `--draft-outtype` adds `..._<outtype>` rows) at k = engine.num_draft_tokens;
`llama_cpp_server_<type>` for each of llama.cpp's n-gram proposers named (`--spec-type`, its own
defaults); with `--tidespec P`, `tidespec serve`'s own rows at precision P beside them, without
speculation and at params.yaml's default config with the adapted draft (`bench.tidespec_server`).
Every row is its own server (`-np` = the highest concurrency); all are started afresh
for each pass and level (llama.cpp's n-gram proposers keep a pool across requests: a later run would
draft an earlier run's outputs of the same prompts) and are up together while it runs.

Per pass, for each concurrency c and workload, every row in turn (the order rotates by pass and
level) serves the workload's prompts from c closed-loop clients: greedy, native `/completion` with
token-id prompts, `cache_prompt: false` (a later pass must not find its prompt cached; tidespec's
engine has no prefix cache either), stopping at EOS or `--max-new-tokens`. tokens/s = generated
tokens / the run's wall time. Each row's paired ratio to no speculation per pass gives the median
and range; a range that spans 1.0 is inside the noise. τ from each server's own counters
(`llamacpp:spec_decode_*`, `tidespec:spec_decode_*`, before and after the run: exact, a request
counts when it finishes). Outputs are compared with the same server's plain decoding at the same
level and pass (`identical`, `plain_of`) and with llama.cpp's (`as_llama_cpp`): llama.cpp's batched
kernels may round otherwise at c > 1, so a share below 1 there is reported, not raised.

    tidespec bench llama-server --static DIR --adapted data/drafts/champion \\
        --prompts-file bench/prompts/unseen.jsonl --concurrency 1 4 8 --passes 3 \\
        --ngram ngram-simple --ngram ngram-mod --out bench/results/llama-server.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from ..backends import llama_cpp
from ..config import load_params
from ..engine.spec_counters import SpecDecodeCounters
from ..models.load import get_target, target_dir
from ..workspace import engine_dir
from . import tidespec_server
from .engine import file_workloads, workload_prompts
from .engine_report import WORKLOADS, _cpu
from .methods import PRECISIONS
from .tidespec_server import ServeRow

NO_SPEC = "llama_cpp_server_no_spec"
NGRAM_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")


def parser() -> argparse.ArgumentParser:
    """The command line (`tidespec bench llama-server` ARGS)."""
    ap = argparse.ArgumentParser(prog="tidespec bench llama-server", description=__doc__.splitlines()[0])
    ap.add_argument("--static", type=Path, help="the static draft (bundle or engine dir): row ..._eagle3_static")
    ap.add_argument("--adapted", type=Path, help="the adapted draft (e.g. data/drafts/champion): ..._eagle3_adapted")
    ap.add_argument("--ngram", action="append", default=[], choices=NGRAM_TYPES,
                    help="a llama.cpp n-gram proposer row (repeat)")
    ap.add_argument("--draft-outtype", action="append", default=[], choices=("f16", "bf16", "q8_0"),
                    help="also the drafts converted at this type (repeat): rows ..._eagle3_<name>_<type>")
    ap.add_argument("--params", type=Path, default=Path("params.yaml"), help="k (engine.num_draft_tokens), prompts")
    ap.add_argument("--prompts-file", type=Path, help="JSONL prompts (bench engine's format); default: built-in sets")
    ap.add_argument("--workload", action="append", default=[], choices=WORKLOADS, help="default: code and chat")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload (at least the highest level)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8], help="closed-loop clients")
    ap.add_argument("--passes", type=int, default=3, help="interleaved passes (paired ratios, their spread)")
    ap.add_argument("--tidespec", action="append", default=[], choices=tuple(PRECISIONS),
                    help="also tidespec serve's rows at this precision (repeat): ..._no_spec and ..._default "
                         "(params.yaml's config with --adapted as the champion)")
    ap.add_argument("--threads", type=int, default=2, help="each server's CPU threads (llama-server -t; "
                                                           "tidespec serve: OMP_NUM_THREADS)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/llama-server.json"))
    return ap


def _check(a: argparse.Namespace) -> None:
    """Refuse what would make the run meaningless before any server starts (SystemExit naming the fix)."""
    if a.passes < 1 or a.prompts < 1 or a.max_new_tokens < 1 or a.threads < 1 or min(a.concurrency) < 1:
        raise SystemExit("--passes, --prompts, --max-new-tokens, --threads and --concurrency must be >= 1")
    if a.prompts < max(a.concurrency):
        raise SystemExit(f"--prompts {a.prompts} < the highest --concurrency {max(a.concurrency)}: "
                         "each client needs a prompt of its own")
    for name in ("static", "adapted"):
        d = getattr(a, name)
        if d is not None and not (engine_dir(d) / "model.safetensors").is_file():
            raise SystemExit(f"--{name} {d}: no draft there (model.safetensors): pass a draft bundle or engine dir")
    if a.tidespec and a.adapted is None:
        raise SystemExit("--tidespec's default rows serve --adapted as the champion: pass --adapted")
    if reason := llama_cpp.unavailable_reason():
        raise SystemExit(f"llama.cpp cannot run here: {reason}")


def rows(a: argparse.Namespace, params, parallel: int) -> dict[str, llama_cpp.LlamaCppLaunch | ServeRow]:
    """Each row's server, by row name: llama-server's (`parallel` slots of 1024 tokens, `a.threads`
    threads, k = `params.engine.num_draft_tokens`; the drafts' GGUFs converted once and cached,
    `draft_gguf`), then `tidespec serve`'s for each `--tidespec` precision. Raises LlamaCppError when
    a conversion fails."""
    k = params.engine.num_draft_tokens
    base = {"parallel": parallel, "ctx_per_slot": 1024, "threads": a.threads}
    out = {NO_SPEC: llama_cpp.LlamaCppLaunch.from_params(params, **base)}
    for name in ("static", "adapted"):
        d = getattr(a, name)
        for outtype in ("f32", *dict.fromkeys(a.draft_outtype)) if d is not None else ():
            gguf = llama_cpp.draft_gguf(engine_dir(d), target_dir(params.target.source), outtype=outtype)
            row = f"llama_cpp_server_eagle3_{name}" + ("" if outtype == "f32" else f"_{outtype}")
            out[row] = llama_cpp.LlamaCppLaunch.from_params(params, draft_path=str(gguf), num_speculative_tokens=k,
                                                            **base)
    for t in dict.fromkeys(a.ngram):
        out[f"llama_cpp_server_{t}"] = llama_cpp.LlamaCppLaunch.from_params(
            params, extra_args=("--spec-type", t), **base)
    if a.tidespec:
        out |= tidespec_server.ServeRow.rows(params, a.tidespec, a.adapted)
    return out


def _complete(client: httpx.Client, url: str, ids: list[int], max_new: int) -> list[int]:
    r = client.post(f"{url}/completion", json={"prompt": ids, "n_predict": max_new, "temperature": 0,
                                               "return_tokens": True, "cache_prompt": False}, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"llama-server at {url} answered {r.status_code}: {r.text[:300]}")
    return r.json()["tokens"]


@dataclass(frozen=True)
class Endpoint:
    """A started row's server: its URL and whether it is `tidespec serve` (else llama-server)."""

    url: str
    tidespec: bool = False

    def complete(self, client: httpx.Client, ids: list[int], max_new: int, workload: str) -> list[int]:
        """One greedy completion of token-id prompt `ids` (≤ `max_new` tokens; `workload`: the class
        tidespec serve is told, llama-server has none): the generated ids. Raises RuntimeError for a
        non-200 answer."""
        if self.tidespec:
            return tidespec_server.complete(client, self.url, ids, max_new, workload)
        return _complete(client, self.url, ids, max_new)

    def scrape(self) -> SpecDecodeCounters | None:
        """The server's cumulative spec-decode counters (None: no speculation counted yet)."""
        return (tidespec_server.scrape if self.tidespec else llama_cpp.scrape)(self.url)


def closed_loop(ep: Endpoint, prompts: list[tuple[str, list[int]]], max_new: int, c: int, workload: str) -> dict:
    """`prompts` from `c` clients, each taking the next prompt when its last one is answered:
    {"tokens": {id: generated ids}, "wall_s", "drafts": the server's counters over the run}."""
    before = ep.scrape()
    t0 = time.perf_counter()
    with httpx.Client(limits=httpx.Limits(max_connections=c)) as cl, ThreadPoolExecutor(c) as ex:
        outs = list(ex.map(lambda p: ep.complete(cl, p[1], max_new, workload), prompts))
    wall = time.perf_counter() - t0
    after = ep.scrape()
    drafts = None
    if after is not None:
        drafts = (after - before if before is not None else after).as_dict()
    return {"tokens": {p[0]: o for p, o in zip(prompts, outs)}, "wall_s": wall, "drafts": drafts}


def measure(urls: dict[str, Endpoint], wl: dict[str, list], ps: int, ci: int, c: int, max_new: int,
            progress=print) -> list[dict]:
    """Pass `ps` at level `c` (the `ci`-th): every (workload, row) run, rows rotated by pass and
    level: a list of {"pass", "c", "workload", "row", **closed_loop(...)}."""
    names, runs = list(urls), []
    for w, prompts in wl.items():
        r0 = (ps + ci) % len(names)
        for row in names[r0:] + names[:r0]:
            r = closed_loop(urls[row], prompts, max_new, c, w)
            runs.append({"pass": ps, "c": c, "workload": w, "row": row, **r})
        progress(f"pass {ps + 1} · c={c} · {w}")
    return runs


def one_run(cfgs: dict[str, llama_cpp.LlamaCppLaunch | ServeRow], logs: Path, wl: dict[str, list], ps: int, ci: int,
            c: int, max_new: int, threads: int) -> list[dict]:
    """Start every row's server (one at a time: starts must not overlap), check that llama-server's
    speculative ones speculate (`/slots`), warm each up, run pass `ps` at level `c` (`measure`),
    stop them all."""
    servers: dict = {}
    eps: dict[str, Endpoint] = {}
    try:
        for name, cfg in cfgs.items():
            if isinstance(cfg, ServeRow):
                servers[name] = tidespec_server.TidespecServer(cfg, logs / f"{name}.log", threads).start()
            else:
                servers[name] = llama_cpp.LlamaCppServer(cfg, logs / f"{name}.log").start()
                if name != NO_SPEC and not llama_cpp.speculating(servers[name].url):
                    raise SystemExit(f"{name}: llama-server does not speculate (/slots); see {logs / name}.log")
            eps[name] = Endpoint(servers[name].url, isinstance(cfg, ServeRow))
        with httpx.Client() as client:  # warm-up, once every server is up (a start's own work is over)
            for ep in eps.values():
                for w, prompts in wl.items():
                    ep.complete(client, prompts[0][1], 8, w)
        return measure(eps, wl, ps, ci, c, max_new)
    finally:
        for s in servers.values():
            s.stop()


def _tau(drafts: list[dict | None]) -> float | None:
    """τ over runs' summed counters (`SpecDecodeCounters.acceptance_length`); None without drafts."""
    got = [SpecDecodeCounters.from_dict(d) for d in drafts if d]
    return sum(got[1:], got[0]).acceptance_length if got else None


def plain_of(row: str) -> str:
    """The row whose outputs `row`'s must equal: its server's own plain decoding (`tidespec serve`'s
    at the row's precision, else llama-server's)."""
    if row.startswith(tidespec_server.ROW_PREFIX):
        precision = row.removeprefix(tidespec_server.ROW_PREFIX).split("_")[0]
        return f"{tidespec_server.ROW_PREFIX}{precision}_no_spec"
    return NO_SPEC


def summarize(runs: list[dict]) -> dict:
    """{c: {workload: {row: tokens/s (median over passes), ratio to NO_SPEC per pass (median, min,
    max, inside_noise), τ, identical (share of prompts equal to its own plain decoding's in the same
    pass, `plain_of`), as_llama_cpp (share equal to NO_SPEC's)}}}."""
    at = {(r["pass"], r["c"], r["workload"], r["row"]): r for r in runs}
    out: dict = {}
    for (ps, c, w, row), r in sorted(at.items(), key=lambda x: (x[0][1], x[0][2], x[0][3], x[0][0])):
        ref, own = at[(ps, c, w, NO_SPEC)], at[(ps, c, w, plain_of(row))]
        cell = out.setdefault(str(c), {}).setdefault(w, {}).setdefault(row, {"tps": [], "ratio": [], "same": [],
                                                                             "llama": [], "drafts": []})
        tps = sum(map(len, r["tokens"].values())) / r["wall_s"]
        cell["tps"].append(tps)
        cell["ratio"].append(tps / (sum(map(len, ref["tokens"].values())) / ref["wall_s"]))
        cell["same"] += [r["tokens"][i] == own["tokens"][i] for i in r["tokens"]]
        cell["llama"] += [r["tokens"][i] == ref["tokens"][i] for i in r["tokens"]]
        cell["drafts"].append(r["drafts"])
    for by_w in out.values():
        for by_row in by_w.values():
            for row, cell in by_row.items():
                lo, hi = min(cell["ratio"]), max(cell["ratio"])
                by_row[row] = {"tokens_per_s": round(statistics.median(cell["tps"]), 2),
                               "ratio": {"median": round(statistics.median(cell["ratio"]), 3), "min": round(lo, 3),
                                         "max": round(hi, 3), "inside_noise": lo <= 1.0 <= hi},
                               "tau": _tau(cell["drafts"]), "identical": sum(cell["same"]) / len(cell["same"]),
                               "as_llama_cpp": sum(cell["llama"]) / len(cell["llama"])}
    return out


def markdown(res: dict) -> str:
    """The report's table: one line per level, workload and row."""
    m = res["machine"]
    lines = [f"# llama-server with and without speculation ({res['date'][:10]})", "",
             f"{m['cpu']}, {m['cores']} cores, {res['setup']['threads']} threads per server; llama.cpp "
             f"{res['setup']['llama_cpp']}; k = {res['setup']['k']}; {res['setup']['prompts']} prompts per workload "
             f"({res['setup']['prompt_source']}), ≤ {res['setup']['max_new_tokens']} new tokens, greedy; "
             f"{res['setup']['passes']} interleaved passes. Ratio: paired per pass against "
             f"`{NO_SPEC}`, median (min–max); * = inside the noise. identical: the share of outputs equal to the "
             "same server's plain decoding (its own no_spec row); as llama.cpp: equal to llama-server's.", "",
             f"Command: `{res['command']}`", "",
             "| c | workload | row | tokens/s | ratio | τ | identical | as llama.cpp |",
             "|---|---|---|---|---|---|---|---|"]
    for c, by_w in res["results"].items():
        for w, by_row in by_w.items():
            for row, s in by_row.items():
                r = s["ratio"]
                tau = f"{s['tau']:.2f}" if s["tau"] else "—"
                ratio = "reference" if row == NO_SPEC else (
                    f"{r['median']:.3f} ({r['min']:.3f}–{r['max']:.3f}){' *' if r['inside_noise'] else ''}")
                lines.append(f"| {c} | {w} | {row} | {s['tokens_per_s']:.1f} | {ratio} | {tau} | "
                             f"{s['identical']:.2f} | {s['as_llama_cpp']:.2f} |")
    return "\n".join(lines) + "\n"


def _provenance(d: Path | None) -> dict | None:
    """A draft's path and what it says of itself (version.json, train_metrics' simulated τ)."""
    if d is None:
        return None
    out: dict = {"path": str(d)}
    for name in ("version.json", "train_metrics.json"):
        f = Path(d) / name
        if f.is_file():
            j = json.loads(f.read_text())
            out[name] = j if name == "version.json" else {k: j.get(k) for k in ("simulated_acceptance_length",
                                                                                 "train_tokens")}
    return out


def main(argv: list[str] | None = None) -> None:
    """Run the bench (`parser` for the arguments): writes `--out` (JSON: setup, drafts' provenance,
    per-level results, every run's wall time and counters) and its `.md` table, and prints the table.
    Exits with the reason (SystemExit) on a refused argument or a row that does not speculate."""
    a = parser().parse_args(argv)
    _check(a)
    params = load_params(a.params)
    tok = get_target(params)[1]
    workloads = a.workload or ["code", "chat"]
    if a.prompts_file is not None:
        workloads = file_workloads(a.prompts_file, workloads)
    wl = {w: v for w, v in workload_prompts(tok, params, a.prompts, a.prompts_file).items() if w in workloads}
    short = {w: len(v) for w, v in wl.items() if len(v) < max(a.concurrency)}
    if short:
        raise SystemExit(f"too few prompts for --concurrency {max(a.concurrency)}: {short}")
    k, levels = params.engine.num_draft_tokens, sorted(set(a.concurrency))
    logs, runs = Path(tempfile.mkdtemp(prefix="tidespec-bench-llama-server-")), []
    for ps in range(a.passes):
        for ci, c in enumerate(levels):  # fresh servers (and free ports) for each run
            cfgs = rows(a, params, max(levels))
            runs += one_run(cfgs, logs, wl, ps, ci, c, a.max_new_tokens, a.threads)
    res = {"benchmark": "llama-server", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "tidespec bench llama-server " + " ".join(argv or []),
           "machine": {"cpu": _cpu(), "cores": os.cpu_count()},
           "setup": {"threads": a.threads, "k": k, "prompts": a.prompts, "max_new_tokens": a.max_new_tokens,
                     "passes": a.passes, "concurrency": levels, "llama_cpp": llama_cpp.LLAMA_CPP_COMMIT,
                     "prompt_source": str(a.prompts_file) if a.prompts_file else "built-in sets",
                     "args": {n: llama_cpp.launch_args(c)[1:] for n, c in cfgs.items() if not isinstance(c, ServeRow)},
                     "tidespec": {n: c.describe() for n, c in cfgs.items() if isinstance(c, ServeRow)}},
           "drafts": {"static": _provenance(a.static), "adapted": _provenance(a.adapted)},
           "results": summarize(runs),
           "runs": [{key: v for key, v in r.items() if key != "tokens"}
                    | {"new_tokens": sum(map(len, r["tokens"].values()))} for r in runs]}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    a.out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))
