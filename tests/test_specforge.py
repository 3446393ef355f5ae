"""SpecForge backend: offline-data conversion, target view, config fields, argv; unavailable without CUDA.

Field names below are those of SpecForge's schema (sgl-project/SpecForge @ a6b6b0230009d15ec2a97a57384e6f53f0f96946,
`specforge/config/schema.py`; every section rejects unknown keys, so a typo here would fail there).
"""
import shutil
from collections import Counter

import pytest
import torch
import yaml

from conftest import make_tiny_workspace
from tidespec.config import DraftParams, TrainParams
from tidespec.train import specforge as sf

SCHEMA = {
    "top": {"model", "data", "training", "tracking", "profiling", "runtime", "deployment", "run_id", "output_dir"},
    "model": {"target_model_path", "draft_model_config", "target_backend", "vocab_mapping_path", "embedding_key",
              "lm_head_key", "torch_dtype", "draft_checkpoint_path"},
    "data": {"train_data_path", "prompts_path", "hidden_states_path", "max_length", "chat_template", "cache_dir"},
    "training": {"strategy", "num_epochs", "max_steps", "batch_size", "accumulation_steps", "learning_rate",
                 "ttt_length", "attention_backend", "save_interval", "log_interval", "max_checkpoints",
                 "resume_from", "seed", "fsdp_sharding"},
}


def _recs(target, n=3, T=20):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(3, target.cfg.vocab_size, (T,), generator=g)
        o = target.forward(ids, target.new_cache(T))
        m = torch.zeros(T, dtype=torch.uint8)
        m[5:] = 1
        out.append({"input_ids": ids.int(), "loss_mask": m, "aux_hidden_states": o.aux.bfloat16(),
                    "hidden_states": o.hidden.bfloat16()})
    return out


def test_offline_samples_match_specforge_layout(tiny_target, tmp_path):
    recs = _recs(tiny_target)
    assert sf.write_offline_data(recs, tmp_path / "hs", max_len=16) == 3
    files = sorted((tmp_path / "hs").rglob("*.ckpt"))
    assert [f.relative_to(tmp_path / "hs").as_posix() for f in files] == [
        "rows_0-2000/data_0.ckpt", "rows_0-2000/data_1.ckpt", "rows_0-2000/data_2.ckpt"]
    s = torch.load(files[1], weights_only=False)
    H = tiny_target.cfg.hidden_size
    assert set(s) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
    assert s["input_ids"].shape == (16,) and s["input_ids"].dtype == torch.int64
    assert s["loss_mask"].dtype == torch.int64 and s["loss_mask"].tolist() == [0] * 5 + [1] * 10 + [0]
    assert s["hidden_state"].shape == (1, 16, H) and s["hidden_state"].dtype == torch.bfloat16
    assert s["aux_hidden_state"].shape == (1, 16, 3 * H)
    assert torch.equal(s["aux_hidden_state"][0], recs[1]["aux_hidden_states"][:16])


def test_target_view_and_config(tiny_target, tiny_target_dir, tmp_path):
    recs = _recs(tiny_target)
    run = sf.prepare_run(recs, tiny_target, tiny_target_dir, DraftParams(draft_vocab_size=64),
                         TrainParams(epochs=2, ttt_steps=4, lr=2e-4), tmp_path / "w")
    conf = yaml.safe_load(run["config"].read_text())
    assert set(conf) <= SCHEMA["top"]
    for sec in ("model", "data", "training"):
        assert set(conf[sec]) <= SCHEMA[sec], sec
    assert conf["training"]["ttt_length"] == 4 and conf["training"]["num_epochs"] == 2
    assert conf["training"]["learning_rate"] == 2e-4 and conf["deployment"]["mode"] == "local_colocated"
    assert conf["data"]["hidden_states_path"] == str(run["data"]) and run["num_samples"] == 3
    view = tmp_path / "w" / "target"
    import json
    index = json.loads((view / "model.safetensors.index.json").read_text())
    assert conf["model"]["lm_head_key"] in index["weight_map"]  # the tiny target ties its embedding
    assert conf["model"]["lm_head_key"] == "model.embed_tokens.weight" and (view / "config.json").exists()
    m = torch.load(run["vocab_mapping"])
    assert m["d2t"].dtype == torch.int64 and m["d2t"].shape == (64,) and m["t2d"].shape == (320,)
    cfg = json.loads(run["draft_config"].read_text())
    assert cfg["draft_vocab_size"] == 64 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    tr, ex = sf.commands("specforge", run["config"], run["checkpoint"], run["draft_config"], run["vocab_mapping"],
                         run["export"])
    assert run["argv"] == (tr, ex)  # the commands train_specforge runs are built from the files prepare_run wrote
    assert tr == ["specforge", "train", "--config", str(run["config"])]
    assert ex[:4] == ["specforge", "export", "--to", "sglang"] and "--vocab-mapping" in ex


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this checks the no-GPU path")
def test_unavailable_without_cuda_says_why(tmp_path, tiny_target_dir, monkeypatch):
    assert "not found" in sf.unavailable_reason("no-such-specforge-binary")
    monkeypatch.setattr(sf.shutil, "which", lambda name: None if name == "nvidia-smi" else "/usr/bin/" + name)
    assert "needs a CUDA GPU" in sf.unavailable_reason("specforge")
    from tidespec.steps.cycle import step_curate, train_candidate
    ws, params, target = make_tiny_workspace(tmp_path, tiny_target_dir)
    step_curate(ws, params, target.target_id)
    p = params.model_copy(update={"train": params.train.model_copy(update={"backend": "specforge",
                                                                         "min_train_tokens": 8})})
    with pytest.raises(sf.SpecForgeUnavailable, match="CUDA GPU"):
        train_candidate(ws, p, ws.curated, None, ws.candidate)
    assert not ws.candidate.exists()


@pytest.mark.gpu
@pytest.mark.skipif(sf.unavailable_reason("specforge") is not None, reason="needs CUDA + a SpecForge env")
def test_specforge_trains_a_loadable_draft(tiny_target, tmp_path):
    recs = _recs(tiny_target, n=8, T=40)
    sf.train_specforge(recs, recs[:2], tiny_target, DraftParams(draft_vocab_size=64),
                       TrainParams(epochs=1, ttt_steps=2), tmp_path / "d")
    from tidespec.models.eagle3 import load_checkpoint
    d = load_checkpoint(tmp_path / "d", tiny_target.embed, tiny_target.target_id)
    assert d.config.draft_vocab_size == 64 and Counter((torch.arange(64) + d.d2t).tolist()).most_common(1)[0][1] == 1


def test_specforge_run_validates_the_saved_draft(tiny_target, tmp_path, monkeypatch):
    """The SpecForge CLI stubbed (its export: a fresh draft of the run's config and vocabulary): the
    export is saved at `out` with train_metrics.json, and its validation figures are those of the
    saved draft loaded back (`holdout.checkpoint_accuracy`), number for number."""
    import json
    import subprocess

    from tidespec.models.eagle3 import Eagle3Config, Eagle3Draft, save_checkpoint
    from tidespec.train.holdout import checkpoint_accuracy

    def fake_run(argv, **kw):
        if argv[1] == "export":
            out_dir = argv[argv.index("--output-dir") + 1]
            cfg = Eagle3Config.from_hf(json.loads(open(argv[argv.index("--draft-config") + 1]).read()))
            torch.manual_seed(1)
            d = Eagle3Draft(cfg)
            vocab = torch.load(argv[argv.index("--vocab-mapping") + 1])
            d.set_vocab(vocab["d2t"], vocab["t2d"])
            save_checkpoint(d, out_dir)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(sf, "unavailable_reason", lambda bin_path: None)
    monkeypatch.setattr(sf.subprocess, "run", fake_run)
    recs = _recs(tiny_target, n=6, T=30)
    tp = TrainParams(epochs=1, ttt_steps=2)
    m = sf.train_specforge(recs[:4], recs[4:], tiny_target, DraftParams(draft_vocab_size=64), tp, tmp_path / "d",
                           log=lambda s: None)
    ev = checkpoint_accuracy(tmp_path / "d", tiny_target, recs[4:], tp)
    assert m["val_positions"] > 0 and m == {"backend": "specforge", "num_samples": 4, "dropped": 0,
                                            **ev.val_metrics(), "simulated_acceptance_length": ev.simulated_tau()}
    assert json.loads((tmp_path / "d" / "train_metrics.json").read_text()) == m
    assert not (tmp_path / "d.specforge").exists()
    unloaded = type(tiny_target).__new__(type(tiny_target))  # no files to read: SpecForge cannot load it
    with pytest.raises(ValueError, match="load_target"):
        sf.train_specforge(recs, recs, unloaded, DraftParams(draft_vocab_size=64), tp, tmp_path / "e")


def test_stale_work_dir_and_user_index_are_never_reused(tiny_target, tiny_target_dir, tmp_path):
    """Breaker findings: another cycle's SpecForge run is not resumed; the target's own index.json is
    not written through a link; NaN records are not exported."""
    import json
    recs = _recs(tiny_target)
    work = tmp_path / "w"
    tp = TrainParams(epochs=1)
    run = sf.prepare_run(recs, tiny_target, tiny_target_dir, DraftParams(draft_vocab_size=64), tp, work)
    latest = run["checkpoint"] / "tidespec-latest"
    latest.mkdir(parents=True)  # as if SpecForge had saved a checkpoint
    again = sf.prepare_run(recs, tiny_target, tiny_target_dir, DraftParams(draft_vocab_size=64), tp, work)
    assert yaml.safe_load(again["config"].read_text())["training"]["resume_from"] == str(latest)  # same run
    recs[0]["aux_hidden_states"][1, 1] = float("nan")
    other = sf.prepare_run(recs, tiny_target, tiny_target_dir, DraftParams(draft_vocab_size=64), tp, work)
    assert "resume_from" not in yaml.safe_load(other["config"].read_text())["training"] and not latest.exists()
    assert other["num_samples"] == 2  # the NaN record is not exported
    user = tmp_path / "user-model"
    shutil.copytree(tiny_target_dir, user)
    (user / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"keep": 1}, "weight_map": {}}))
    sf.target_view(user, tmp_path / "view")
    assert json.loads((user / "model.safetensors.index.json").read_text())["metadata"] == {"keep": 1}
    assert not (tmp_path / "view" / "model.safetensors.index.json").is_symlink()
