"""The experiment scripts of `tidespec bench`: argparse programs of their own, one module each in
this package with `main(argv)` (their --help is theirs), registered on the bench CLI by name."""
from __future__ import annotations

import typer

SCRIPTS = {
    "inprocess-ab": ("inprocess_ab", "A speculation config vs no speculation, both engines in one process "
                                     "(the engine's own work per step, paired ratios)."),
    "static-baseline": ("static_baseline", "τ per workload of static and adapted drafts (fixed chain k; trees)."),
    "vllm-agreement": ("vllm_agreement", "vLLM and tidespec's engine, same prompts and draft: equal tokens, counters."),
    "llama-cpp-agreement": ("llama_cpp_agreement", "llama.cpp against tidespec's int4 engine, same draft: acceptance."),
    "llama-server": ("llama_server", "llama.cpp's server without speculation, with EAGLE-3 (static, adapted "
                                     "drafts) and its n-gram proposers, at c = 1, 4, 8: paired ratios, τ."),
    "vllm-swap": ("vllm_swap", "A new draft into a serving vLLM: in place against blue/green (seconds, memory)."),
    "grammar-libs": ("grammar_libs", "xgrammar vs llguidance: compile, mask and consume costs on the target's "
                                     "tokenizer."),
    "pretrain-code": ("pretrain_code", "A draft pretrained on teacher-forced generic code (the standard library)."),
    "fp8-capture": ("fp8_capture", "Drafts trained on hidden states as captured (bf16) and after fp8 at rest, "
                                   "paired per seed: simulated τ on the same holdout."),
    "static-general": ("static_general", "A well-trained general static draft (≥ 1M ShareGPT tokens, resumable), "
                                         "its curve per epoch on a general holdout."),
    "train-ab": ("train_ab", "Training arms (train.* changes) paired per seed on code traffic a draft served: "
                             "replayed and simulated τ on a holdout."),
    "vocab-coverage": ("vocab_coverage", "The share of the target's output on captured traffic inside each "
                                         "draft's vocabulary, and the vocabulary size chosen from data."),
}


def register_script(app, name: str, module: str, doc: str) -> None:
    """`tidespec bench NAME ARGS...` on typer `app`: runs `tidespec.bench.<module>.main(ARGS)`."""
    @app.command(name, help=f"{doc} Arguments: `tidespec bench {name} --help`.", add_help_option=False,
                  context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
    def run(ctx: typer.Context) -> None:
        import importlib
        importlib.import_module(f"{__package__}.{module}").main(list(ctx.args))
