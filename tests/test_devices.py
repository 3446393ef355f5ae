"""Devices and precision: `target.device` places the target (and the engine's caches and draft
runner), `train.device` / `train.precision` the trainer. CPU float32 is the default and the tested
path; the `gpu` tests run the CUDA paths wherever torch sees a GPU."""
from __future__ import annotations

import pytest
import torch

from conftest import random_draft, tiny_records
from tidespec.config import DraftParams, EngineParams, Params, TrainParams, load_params
from tidespec.models.device import autocast_dtype, resolve_device
from tidespec.models.eagle3 import load_checkpoint
from tidespec.train.trainer import train_draft

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() is False here)")


def test_device_settings_resolve_or_are_refused_naming_the_setting():
    assert resolve_device("auto", "train.device") == torch.device("cuda" if CUDA else "cpu")
    assert resolve_device("cpu", "target.device") == torch.device("cpu")
    if not CUDA:
        with pytest.raises(ValueError, match=r"^train.device: cuda:1 but torch sees no CUDA GPU here"):
            resolve_device("cuda:1", "train.device")
    with pytest.raises(ValueError, match=r"target.device\n  String should match pattern"):
        Params.model_validate({"target": {"device": "gpu"}})
    assert autocast_dtype("auto", torch.device("cpu")) is None  # CPU trains in fp32 by default
    assert autocast_dtype("auto", torch.device("cuda")) is torch.bfloat16
    assert autocast_dtype("bfloat16", torch.device("cpu")) is torch.bfloat16
    assert autocast_dtype("float32", torch.device("cuda")) is None


def test_train_precision_takes_torch_names_and_refuses_the_old_spellings(tmp_path):
    """train.precision is spelled as target.dtype (float32, bfloat16; or auto); the old fp32 / bf16
    are refused naming the new spelling, never read as something else."""
    assert TrainParams(precision="bfloat16").precision == "bfloat16"
    for old, new in (("fp32", "float32"), ("bf16", "bfloat16")):
        f = tmp_path / f"{old}.yaml"
        f.write_text(f"train:\n  precision: {old}\n")
        with pytest.raises(ValueError, match=rf"train\.precision: '{old}' is spelled '{new}' now: "
                                             rf"write train\.precision: {new}$"):
            load_params(f)
    with pytest.raises(ValueError, match="Input should be 'auto', 'float32' or 'bfloat16'"):
        TrainParams(precision="fp16")


def test_bf16_autocast_trains_and_is_not_the_fp32_run(tiny_target, tmp_path):
    """train.precision: bfloat16 runs the forward and loss under autocast (weights and AdamW stay
    float32): it learns (the loss falls over 4 epochs) and gives other weights than float32 — a precision
    setting that changed nothing would give identical weights. Both drafts are saved in fp32."""
    recs = tiny_records(tiny_target, n=8)
    dp = DraftParams(draft_vocab_size=64)
    runs = {}
    for prec in ("float32", "bfloat16"):
        tp = TrainParams(epochs=4, ttt_steps=2, batch_tokens=80, lr=3e-3, device="cpu", precision=prec)
        m = train_draft(recs[:6], recs[6:], tiny_target, dp, tp, tmp_path / prec)
        assert (m["train_device"], m["train_precision"]) == ("cpu", prec)
        assert m["train/loss"][-1] < m["train/loss"][0], m["train/loss"]
        runs[prec] = load_checkpoint(tmp_path / prec, tiny_target.embed, tiny_target.target_id)
    w32, w16 = runs["float32"].fc.weight, runs["bfloat16"].fc.weight
    assert w16.dtype == torch.float32 and not torch.equal(w32, w16)


@pytest.mark.gpu
@needs_cuda
def test_cuda_train_step_and_checkpoint_loaded_back(tiny_target, tmp_path):
    """One training run on CUDA (bf16 autocast, the CUDA default): it learns, reports its device,
    and the checkpoint loads back on CPU with finite weights."""
    recs = tiny_records(tiny_target, n=8)
    tp = TrainParams(epochs=2, ttt_steps=2, batch_tokens=80, lr=3e-3, device="cuda")
    m = train_draft(recs[:6], recs[6:], tiny_target, DraftParams(draft_vocab_size=64), tp, tmp_path / "d")
    assert (m["train_device"], m["train_precision"]) == ("cuda", "bfloat16")
    assert m["train/loss"][-1] < m["train/loss"][0]
    d = load_checkpoint(tmp_path / "d", tiny_target.embed, tiny_target.target_id)
    assert all(torch.isfinite(p).all() and p.device.type == "cpu" for p in d.parameters())


@pytest.mark.gpu
@needs_cuda
def test_cuda_engine_is_lossless(tiny_target_dir):
    """The engine on a CUDA target (KV caches and draft runner there, logits to CPU for the
    sampler): speculative greedy output equals the target alone on the same device."""
    from tidespec.engine.speculative import Engine
    from tidespec.models.runner import DraftRunner
    from tidespec.models.target import load_target
    target = load_target(tiny_target_dir, device="cuda")[0]
    assert target.embed.device.type == "cuda" and target.new_cache(64).k.device.type == "cuda"
    runner = DraftRunner(random_draft(target, 64).to_device(target.device))
    cfg = EngineParams(num_draft_tokens=3, max_seq_len=256)
    prompts = [[5, 17, 33, 2 + i, 90, 41] for i in range(4)]
    spec = [Engine(target, runner, cfg).generate(p, 16).tokens for p in prompts]
    plain = [Engine(target, None, cfg).generate(p, 16, speculative=False).tokens for p in prompts]
    assert spec == plain


@pytest.mark.gpu
@needs_cuda
def test_cuda_engine_with_the_goodput_policy_calibrates_and_swaps(tiny_target_dir):
    """The serving path as `tidespec serve` builds it on a CUDA target: `make_engine` with the goodput
    policy calibrates (draft steps timed on the device), a hot-swap times the new draft, and output
    equals the target alone."""
    from tidespec.engine.build import make_engine
    from tidespec.models.runner import DraftRunner
    from tidespec.models.target import load_target
    target = load_target(tiny_target_dir, device="cuda")[0]
    runner = DraftRunner(random_draft(target, 64).to_device(target.device))
    eng = make_engine(EngineParams(num_draft_tokens=3, max_seq_len=256), target, runner)
    eng.set_draft(DraftRunner(random_draft(target, 64, seed=4).to_device(target.device)), "v2")
    plain = make_engine(EngineParams(num_draft_tokens=3, max_seq_len=256).fixed(), target)
    prompt = [5, 17, 33, 90, 41]
    assert eng.generate(prompt, 16).tokens == plain.generate(prompt, 16, speculative=False).tokens


@pytest.mark.gpu
@needs_cuda
def test_cuda_engine_serves_a_draft_per_class_losslessly(tiny_target_dir):
    """Class drafts on a CUDA target: each class's requests draft with its own draft in one batch,
    outputs equal the target alone, and the resident budget counts device weights (no oneDNN packs)."""
    from tidespec.engine.speculative import Engine, Request
    from tidespec.models.runner import DraftRunner
    from tidespec.models.target import load_target
    target = load_target(tiny_target_dir, device="cuda")[0]
    gen, code = (DraftRunner(random_draft(target, 64, seed=s).to_device(target.device)) for s in (0, 1))
    own = sum(t.numel() * t.element_size() for t in code.draft.state_dict().values())
    assert own <= code.weight_bytes < 2 * own  # no prepacked copies on CUDA
    cfg = EngineParams(num_draft_tokens=3, max_seq_len=256, adaptive=False)
    eng = Engine(target, gen, cfg, draft_version="1")
    eng.set_draft(code, "7", workload="code")
    prompts = [[5, 17, 33, 2 + i, 90, 41] for i in range(4)]
    wls = ["code", "chat", "code", "chat"]
    got = eng.generate_batch([Request(p, 16, workload=w) for p, w in zip(prompts, wls)])
    plain = [Engine(target, None, cfg).generate(p, 16, speculative=False).tokens for p in prompts]
    assert [g.tokens for g in got] == plain and [g.draft_version for g in got] == ["7", "1", "7", "1"]
