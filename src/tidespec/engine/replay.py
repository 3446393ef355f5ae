"""Replay prompts through engine configurations side by side (evaluation and benchmarks).

Greedy, wave by wave: each wave of `concurrency` prompts runs as one engine batch per
configuration, configurations interleaved per wave, so load drift on a shared machine hits all of
them alike. Metrics use the spec-decode names of `engine.stats` (vLLM `v1/spec_decode/metrics.py`).
"""
from __future__ import annotations

import time

from .speculative import Engine, Request
from .stats import SpecDecodingStats, itl_percentiles, tau_standard_error


def replay(configs: dict[str, tuple[Engine, bool]], prompts: list[dict], max_new_tokens: int,
           reference: str | None = None, progress=None, concurrency: int = 1) -> dict[str, dict]:
    """Run the prompts greedily through every configuration, `concurrency` requests at a time (one
    engine batch), interleaved wave by wave (so machine load drifts hit all configurations alike).
    configs: name → (engine, speculative); an engine batches up to its max_batch. A prompt is a dict
    {"id", "input_ids", "workload"?, "compiled_grammar"?}: a constrained prompt's compiled grammar
    (`engine.grammar_state.Grammar`) constrains it in every configuration.

    Returns name → {"metrics", "outputs", "mismatched_ids"}; with `reference` (a config name, run
    first per wave) mismatches count outputs that differ from that config's. Metrics:
    acceptance_length, acceptance_rate, accepted_per_pos/{i}, acceptance_length/{workload},
    tau_se/{workload}, first_token_acceptance/{workload} and num_drafts/{workload} (τ, its standard error
    `stats.tau_standard_error`, first-token acceptance and chains per workload tag of the prompts),
    tokens_per_s (generated tokens / wall seconds of the waves, incl. prefill), itl_ms_p50/p99,
    new_tokens, seconds, mismatches. Raises ValueError for concurrency < 1.
    """
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    acc = {
        name: {
            "stats": SpecDecodingStats(eng.cfg.num_draft_tokens if spec else 0),
            "outs": {},
            "itl": [],
            "toks": 0,
            "secs": 0.0,
            "by_workload": {},
        }
        for name, (eng, spec) in configs.items()
    }
    for w in range(0, len(prompts), concurrency):
        wave = prompts[w:w + concurrency]
        for name, (eng, spec) in configs.items():
            reqs = [Request(list(p["input_ids"]), max_new_tokens, spec, workload=p.get("workload", "default"),
                            grammar=p.get("compiled_grammar")) for p in wave]
            t0 = time.perf_counter()
            gens = eng.generate_batch(reqs)
            a = acc[name]
            a["secs"] += time.perf_counter() - t0
            for p, g in zip(wave, gens):
                a["outs"][p["id"]] = g.tokens
                a["stats"] = a["stats"].merge(g.stats)
                workload = p.get("workload", "default")
                so_far = a["by_workload"].get(workload, SpecDecodingStats(eng.cfg.num_draft_tokens if spec else 0))
                a["by_workload"][workload] = so_far.merge(g.stats)
                a["itl"] += g.timing.itl_ms()
                a["toks"] += len(g.tokens)
            if progress:
                progress()
    res = {}
    for name, (_, spec) in configs.items():
        a = acc[name]
        ref = acc[reference]["outs"] if reference else None
        mism = [i for i, t in a["outs"].items() if ref is not None and ref.get(i) != t]
        m = a["stats"].metrics() if spec else {"acceptance_length": 1.0}
        if spec:  # τ and first-token acceptance per workload class (the holdout's workload tags)
            for workload, st in sorted(a["by_workload"].items()):
                m[f"acceptance_length/{workload}"] = st.metrics()["acceptance_length"]
                if st.num_drafts:
                    m[f"tau_se/{workload}"] = tau_standard_error(st.accepted_per_pos, st.num_drafts)
                    m[f"first_token_acceptance/{workload}"] = st.num_accepted_tokens_per_pos[0] / st.num_drafts
                    m[f"num_drafts/{workload}"] = st.num_drafts
        m.update(itl_percentiles(a["itl"]))
        m.update({"tokens_per_s": a["toks"] / a["secs"] if a["secs"] else 0.0, "new_tokens": a["toks"],
                  "seconds": a["secs"], "mismatches": len(mism)})
        res[name] = {"metrics": m, "outputs": a["outs"], "mismatched_ids": mism}
    return res
