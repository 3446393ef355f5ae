"""A tidespec draft (`draft/`: config.json + model.safetensors, `LlamaForCausalLMEagle3`) as the
EAGLE-3 GGUF llama.cpp loads with `-md`, written by the build's own `convert_hf_to_gguf.py
--target-model-dir TARGET_HF_DIR` (`draft_gguf`), once per content (`draft_key`).

What the converter does with it (llama.cpp `conversion/llama.py`): it reads the top-level
`eagle_aux_hidden_state_layer_ids` (exactly 3; tidespec writes them in the HF/vLLM "input of layer"
numbering llama.cpp uses, `t_layer_inp[k]`) into `eagle3.target_layers`, takes the target's vocabulary,
merges and chat template from TARGET_HF_DIR, turns `d2t` into absolute target ids and drops `t2d`.
A wrong aux-layer order or vocabulary map converts without error and makes acceptance collapse:
tests/test_llama_cpp_real.py checks that it does.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ...assets import cache_dir, sha256_cached
from ...workspace import DRAFT_FILES, engine_dir
from .build import LLAMA_CPP_COMMIT, converter_env, server_home
from .server import LlamaCppError

TARGET_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")  # what the converter takes from the target


def draft_key(draft: Path, target_hf_dir: Path, outtype: str = "f32") -> str:
    """The converted file's key: sha256 over the llama.cpp commit, `outtype`, the draft's engine files
    and the target files the converter reads (20 hex digits). Raises FileNotFoundError naming a
    missing file."""
    h = hashlib.sha256(f"{LLAMA_CPP_COMMIT} {outtype}".encode())
    for f in [engine_dir(draft) / n for n in DRAFT_FILES] + [Path(target_hf_dir) / n for n in TARGET_FILES]:
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing: a draft needs {', '.join(DRAFT_FILES)}, a target HF dir "
                                    f"{', '.join(TARGET_FILES)}")
        h.update(f"{f.name} {sha256_cached(f)}".encode())
    return h.hexdigest()[:20]


def drafts_dir(cache: Path | None = None) -> Path:
    """Where converted drafts are kept: `<cache>/llama-server/drafts`."""
    return (cache or cache_dir()) / "llama-server" / "drafts"


def draft_gguf(draft: Path, target_hf_dir: Path, cache: Path | None = None, home: Path | None = None,
               outtype: str = "f32", timeout_s: float = 900.0) -> Path:
    """The EAGLE-3 GGUF of `draft` (a bundle or its `draft/` dir) for the target whose HF dir is
    `target_hf_dir` (`models.hf_files.target_dir`), converted with `home`'s converter (default
    `build.server_home()`) into `drafts_dir(cache)/<draft_key>.gguf` unless already there (written
    to a temp file, then renamed: a reader never sees a partial GGUF). `outtype`: f32 (tidespec's
    weights as trained) or f16. Raises FileNotFoundError (a missing file), LlamaCppError (the
    converter failed: its output's tail)."""
    out = drafts_dir(cache) / f"{draft_key(draft, target_hf_dir, outtype)}.gguf"
    if out.is_file():
        return out
    home = Path(home) if home is not None else server_home()
    script = home / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise LlamaCppError(f"{script} is missing: run `make llama-server` (it keeps the tree's converter)")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".convert-") as tmp:
        part = Path(tmp) / out.name
        cmd = [sys.executable, str(script), str(engine_dir(draft)), "--target-model-dir", str(target_hf_dir),
               "--outtype", outtype, "--outfile", str(part)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, env=converter_env(home), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise LlamaCppError(f"converting {draft} took over {timeout_s:g} s") from None
        if r.returncode != 0 or not part.is_file():
            tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-8:])
            raise LlamaCppError(f"convert_hf_to_gguf.py failed on {draft} (exit {r.returncode}):\n{tail}")
        os.chmod(part, 0o644)
        os.replace(part, out)
    return out
