"""The SpecForge training backend (GPU): tidespec snapshots → SpecForge offline data → `specforge train`
→ export to a draft directory (`train_specforge`).

SpecForge pins its own torch and its EAGLE3 loss is a Triton GPU kernel, so it lives in its own
environment and is driven through its CLI (a process boundary, never an import). Raises
SpecForgeUnavailable naming the fix without CUDA or its environment. The SpecForge source facts it
relies on (config schema, offline files, vocabulary mapping, export): docs/design/train.md.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import torch
import yaml
from safetensors import safe_open

from ..config import DraftParams, TrainParams
from ..errors import Unavailable
from ..models.eagle3 import Eagle3Config, build_vocab, count_tokens, load_checkpoint, save_checkpoint
from ..models.target import Target
from .holdout import holdout_accuracy
from .resume import fingerprint, records_fingerprint


class SpecForgeUnavailable(Unavailable):
    """The SpecForge backend cannot run here (no CUDA device, or no `specforge` executable)."""


def unavailable_reason(bin_path: str) -> str | None:
    """Why `specforge train` cannot run on this machine, or None when it can."""
    exe = shutil.which(bin_path)
    if exe is None:
        return (f"SpecForge CLI {bin_path!r} not found: install SpecForge in its own environment "
                "(it pins torch 2.11 / sglang 0.5.14) and set train.specforge_bin to its `specforge` executable")
    if shutil.which("nvidia-smi") is None or subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode:
        return ("SpecForge needs a CUDA GPU (its EAGLE3 loss is a Triton GPU kernel; no nvidia-smi / no device "
                "here); use train.backend: embedded on CPU")
    return None


def write_offline_data(records: list[dict], out: Path, max_len: int) -> int:
    """Write capture records as SpecForge offline samples `out/rows_{a}-{a+2000}/data_{i}.ckpt`.

    Shapes/dtypes as the module docstring; sequences cut to `max_len`. The last loss-mask entry is
    zeroed (it has no next token to predict, as SpecForge's own capture does). Records with NaN/Inf
    hidden states or under 3 tokens are skipped. Returns the number written.
    """
    n = 0
    for r in records:
        T = min(int(r["input_ids"].shape[0]), max_len)
        if T < 3 or not (
            torch.isfinite(r["hidden_states"][:T]).all() and torch.isfinite(r["aux_hidden_states"][:T]).all()
        ):
            continue  # as the embedded trainer: NaN/Inf or too short → dropped (the caller counts the gap)
        i = n
        lm = r["loss_mask"][:T].to(torch.int64).clone()
        lm[-1] = 0
        sample = {"input_ids": r["input_ids"][:T].to(torch.int64), "loss_mask": lm,
                  "hidden_state": r["hidden_states"][:T].to(torch.bfloat16).unsqueeze(0),
                  "aux_hidden_state": r["aux_hidden_states"][:T].to(torch.bfloat16).unsqueeze(0)}
        d = out / f"rows_{i // 2000 * 2000}-{i // 2000 * 2000 + 2000}"
        d.mkdir(parents=True, exist_ok=True)
        torch.save(sample, d / f"data_{i}.ckpt")
        n += 1
    return n


def target_view(target_dir: Path, out: Path) -> tuple[Path, str]:
    """A directory SpecForge's TargetHead reads: links to the target's files plus a
    `model.safetensors.index.json`. Returns (dir, lm_head_key); tied embeddings → the embedding key."""
    shutil.rmtree(out, ignore_errors=True)  # fresh links: the target may have changed
    out.mkdir(parents=True)
    for f in Path(target_dir).iterdir():
        if not f.name.endswith(".index.json"):  # ours is written below; never write through a link
            (out / f.name).symlink_to(f.resolve())
    weight_map = {}
    for st in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(st), "pt") as fh:
            weight_map.update({k: st.name for k in fh.keys()})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    key = "lm_head.weight" if "lm_head.weight" in weight_map else "model.embed_tokens.weight"
    return out, key


def train_config(target_view_dir: Path, lm_head_key: str, draft_config: Path, vocab_mapping: Path,
                 data_dir: Path, out_dir: Path, tparams: TrainParams, resume_from: Path | None = None) -> dict:
    """The SpecForge YAML (as a dict) for offline EAGLE3 training with tidespec's params."""
    training = {"strategy": "eagle3", "num_epochs": tparams.epochs, "learning_rate": tparams.lr,
                "ttt_length": tparams.ttt_steps, "batch_size": 1, "attention_backend": "sdpa",
                "save_interval": tparams.checkpoint_every, "seed": tparams.seed}
    if resume_from is not None:
        training["resume_from"] = str(resume_from)
    return {"model": {"target_model_path": str(target_view_dir), "draft_model_config": str(draft_config),
                      "vocab_mapping_path": str(vocab_mapping), "lm_head_key": lm_head_key,
                      "target_backend": "sglang", "torch_dtype": "bfloat16"},
            "data": {"hidden_states_path": str(data_dir), "max_length": tparams.max_seq_len,
                     "cache_dir": str(out_dir / "cache")},
            "training": training, "run_id": "tidespec", "output_dir": str(out_dir / "runs"),
            "deployment": {"mode": "local_colocated",  # SpecForge launches its own ranks: train.nproc_per_node / nnodes
                           "trainer": {"nnodes": tparams.nnodes, "nproc_per_node": tparams.nproc_per_node}}}


def commands(bin_path: str, config: Path, checkpoint: Path, draft_config: Path, vocab_mapping: Path,
             export_dir: Path) -> tuple[list[str], list[str]]:
    """(train argv, export argv)."""
    train = [bin_path, "train", "--config", str(config)]
    export = [bin_path, "export", "--to", "sglang", "--checkpoint", str(checkpoint), "--draft-config",
              str(draft_config), "--output-dir", str(export_dir), "--vocab-mapping", str(vocab_mapping)]
    return train, export


def prepare_run(train_records: list[dict], target: Target, target_dir: Path, dparams: DraftParams,
                tparams: TrainParams, work: Path, bin_path: str = "specforge") -> dict:
    """Write everything `specforge train` needs under `work`; returns paths, the draft config and
    `argv` (the train and export commands of `bin_path`, as `commands`).
    A `work` dir left by a run with other data/params/target is wiped first (resume only the same run)."""
    ranks = {"nproc_per_node": tparams.nproc_per_node, "nnodes": tparams.nnodes}  # SpecForge's batch is per rank
    fp = fingerprint(tparams.learning_dump() | ranks, dparams.model_dump(), target.target_id,
                     records_fingerprint(train_records))
    if (work / "fingerprint").exists() and (work / "fingerprint").read_text() != fp:
        shutil.rmtree(work)  # another cycle's run: never resume it
    work.mkdir(parents=True, exist_ok=True)
    (work / "fingerprint").write_text(fp)
    data, mapping, draft_json = work / "hidden_states", work / "vocab_mapping.pt", work / "draft_config.json"
    shutil.rmtree(data, ignore_errors=True)
    n = write_offline_data(train_records, data, tparams.max_seq_len)
    view, key = target_view(target_dir, work / "target")
    latest = work / "runs" / "tidespec-latest"
    conf = train_config(view, key, draft_json, mapping, data, work, tparams,
                        resume_from=latest if latest.exists() else None)
    argv = commands(bin_path, work / "specforge.yaml", work / "runs", draft_json, mapping, work / "export")
    cfg = Eagle3Config.for_target(target.cfg, target.aux_layers, dparams.draft_vocab_size,
                                  dparams.intermediate_size, target.target_id)
    counts: Counter = count_tokens([r["input_ids"] for r in train_records], [r["loss_mask"] for r in train_records])
    d2t, t2d = build_vocab(counts, cfg.draft_vocab_size, cfg.vocab_size)
    torch.save({"d2t": d2t, "t2d": t2d}, mapping)
    draft_json.write_text(json.dumps(cfg.to_hf(), indent=2))
    (work / "specforge.yaml").write_text(yaml.safe_dump(conf, sort_keys=False))
    return {"config": work / "specforge.yaml", "draft_config": draft_json, "vocab_mapping": mapping,
            "data": data, "num_samples": n, "checkpoint": work / "runs", "export": work / "export", "eagle3": cfg,
            "argv": argv}


def train_specforge(train_records: list[dict], val_records: list[dict], target: Target, dparams: DraftParams,
                    tparams: TrainParams, out: Path, bin_path: str = "specforge", log=print) -> dict:
    """Train with SpecForge and write a tidespec checkpoint at `out` (same layout as the embedded
    trainer, tidespec fields added to config.json, plus train_metrics.json), as `trainer.train_draft`
    does. SpecForge reads the target from its files (`Target.source_dir`, set by
    `models.target.load_target`) and starts from scratch (no warm start: it loads its own
    checkpoints). The exported draft is validated on `val_records` with the embedded trainer's code
    (`holdout.holdout_accuracy`, fp32 on the CPU with the target's embedding, as saved), so both
    backends report the same `val/*` and `simulated_acceptance_length`. Returns those and
    `backend`, `num_samples`, `dropped`. Raises SpecForgeUnavailable when it cannot run here,
    ValueError for a target without `source_dir`, RuntimeError (with the log tail) when SpecForge
    fails. A rerun resumes from SpecForge's `-latest` checkpoint of the same run (same data,
    params, target)."""
    reason = unavailable_reason(bin_path)
    if reason:
        raise SpecForgeUnavailable(reason)
    if target.source_dir is None:
        raise ValueError("SpecForge loads the target from its files: load it with models.target.load_target")
    work = Path(out).with_name(Path(out).name + ".specforge")
    run = prepare_run(train_records, target, target.source_dir, dparams, tparams, work, bin_path)
    for argv in run["argv"]:
        log(" ".join(argv))
        p = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        if p.returncode:
            raise RuntimeError(f"{argv[1]} failed (exit {p.returncode}):\n{(p.stdout + p.stderr)[-4000:]}")
    draft = load_checkpoint(run["export"], target.embed.cpu())  # SpecForge's export, validated by our loader
    if draft.config.aux_layer_ids != tuple(target.aux_layers) or draft.config.vocab_size != target.cfg.vocab_size:
        raise RuntimeError(f"SpecForge export {run['export']} does not match the target: {draft.config}")
    object.__setattr__(draft.config, "target_id", target.target_id)  # frozen; the export has no tidespec fields
    save_checkpoint(draft, out, extra={"trainer": "specforge"})
    shutil.rmtree(work, ignore_errors=True)  # done: the next cycle must not resume this run
    ev = holdout_accuracy(draft.eval(), target, val_records, tparams)  # the draft just saved, as loaded back
    m = {"backend": "specforge", "num_samples": run["num_samples"], "dropped": len(train_records) - run["num_samples"],
         **ev.val_metrics(), "simulated_acceptance_length": ev.simulated_tau()}
    (Path(out) / "train_metrics.json").write_text(json.dumps(m, indent=2))
    return m
