"""The saved draft loads in SGLang's and vLLM's EAGLE3 loaders: key set, shapes, config fields.

Neither engine installs here (CUDA-only kernels, own torch pins), so each loader's name mapping is
replayed over our checkpoint against the parameter list of the engine's model class. Both lists and
rules are read from the upstream sources (paraphrased, no code copied):

- SGLang `python/sglang/srt/models/llama_eagle3.py` @ 03d5a7771f6082e7737a5f19cae7d1e863087013
  (`LlamaForCausalLMEagle3.load_weights`): `d2t` → `hot_token_id = d2t + arange`; `t2d` skipped;
  q/k/v → `qkv_proj` shards, gate/up → `gate_up_proj`; a name is used as-is if it is a parameter,
  else `model.<name>`; names matching nothing are silently ignored (so we assert none is).
  Single-layer variant d737979cbd17c6162f39c1953cfa72d3d23cc0d0 has the same parameters.
- vLLM `vllm/model_executor/models/llama_eagle3.py` @ 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190
  (`Eagle3LlamaForCausalLM.load_weights`, `LlamaModel.load_weights`): `t2d` skipped; `d2t` →
  `draft_id_to_target_id`; every other name except `lm_head*` gets `model.`; inside the model
  `midlayer.` → `layers.0.`; same stacking; an unknown name raises (KeyError in `params_dict`);
  `embed_tokens` skipped when absent. Logits: `logits_new[:, arange(Vd) + d2t] = logits`.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import random_draft
from tidespec.models.eagle3 import save_checkpoint

STACKED = [(".q_proj", ".qkv_proj"), (".k_proj", ".qkv_proj"), (".v_proj", ".qkv_proj"),
           (".gate_proj", ".gate_up_proj"), (".up_proj", ".gate_up_proj")]


def _shapes(c):
    """Parameter shapes of the engines' EAGLE3 modules for a draft config `c` (per the sources)."""
    H, inter, hd = c.hidden_size, c.intermediate_size, c.head_dim
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd
    layer = {"self_attn.qkv_proj.weight": (qkv, 2 * H), "self_attn.o_proj.weight": (H, c.num_attention_heads * hd),
             "mlp.gate_up_proj.weight": (2 * inter, H), "mlp.down_proj.weight": (H, inter),
             "input_layernorm.weight": (H,), "hidden_norm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    common = {"model.fc.weight": (H, 3 * c.target_hidden_size), "model.norm.weight": (H,),
              "model.embed_tokens.weight": (c.vocab_size, H), "lm_head.weight": (c.draft_vocab_size, H)}
    sglang = {**common, **{f"model.midlayer.{k}": v for k, v in layer.items()}}
    vllm = {**common, **{f"model.layers.0.{k}": v for k, v in layer.items()},
            "draft_id_to_target_id": (c.draft_vocab_size,)}
    return sglang, vllm


def _stack(name):
    for shard, fused in STACKED:
        if shard in name:
            return name.replace(shard, fused), shard
    return name, None


def _fill(filled, name, shard, t):
    filled.setdefault(name, []).append((shard, tuple(t.shape)))


def sglang_load(sd, params):
    """Returns (param → [(shard, shape)], hot_token_id, ignored names)."""
    filled, hot, ignored = {}, None, []
    for name, t in sd.items():
        if "d2t" in name:
            hot = t + torch.arange(t.shape[0])
            continue
        if "t2d" in name:
            continue
        n, shard = _stack(name)
        p = n if n in params else f"model.{n}"
        if p in params:
            _fill(filled, p, shard, t)
        else:
            ignored.append(name)
    return filled, hot, ignored


def vllm_load(sd, params):
    """Returns param → [(shard, shape)]; raises KeyError on a name the model does not have."""
    filled = {}
    for name, t in sd.items():
        if "t2d" in name:
            continue
        if "d2t" in name:
            name = name.replace("d2t", "draft_id_to_target_id")
        elif "lm_head" not in name:
            name = "model." + name.replace("midlayer.", "layers.0.")
        n, shard = _stack(name)
        if n not in params:
            raise KeyError(n)
        _fill(filled, n, shard, t)
    return filled


def _check_fused(filled, params, c):
    hd = c.head_dim
    for p, shape in params.items():
        if p in ("model.embed_tokens.weight",):
            assert p not in filled  # the target's embedding is shared, never saved
            continue
        parts = sorted(filled[p], key=lambda x: str(x[0]))  # shards load by id, in any order
        if "qkv_proj" in p:
            assert [s for s, _ in parts] == [".k_proj", ".q_proj", ".v_proj"]
            assert sum(sh[0] for _, sh in parts) == shape[0] and {sh[1] for _, sh in parts} == {shape[1]}
            assert parts[1][1][0] == c.num_attention_heads * hd and parts[0][1][0] == c.num_key_value_heads * hd
        elif "gate_up_proj" in p:
            assert [s for s, _ in parts] == [".gate_proj", ".up_proj"]  # sorted
            assert sum(sh[0] for _, sh in parts) == shape[0] and {sh[1] for _, sh in parts} == {shape[1]}
        else:
            assert parts == [(None, shape)], p


@pytest.fixture
def saved(tiny_target, tmp_path):
    from collections import Counter
    counts = Counter({t: 320 - t for t in range(100, 300)})
    d = random_draft(tiny_target, vd=64, counts=counts)
    save_checkpoint(d, tmp_path / "draft")
    return d, tmp_path / "draft"


def test_sglang_loader_fills_every_parameter(saved):
    d, path = saved
    sd = load_file(str(path / "model.safetensors"))
    sg, _ = _shapes(d.config)
    filled, hot, ignored = sglang_load(sd, sg)
    assert ignored == []  # SGLang would drop these silently
    _check_fused(filled, sg, d.config)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    assert torch.equal(hot, torch.arange(64) + d.d2t)  # draft id → target id
    assert hot.min() >= 100 and hot.max() < 300  # pruned vocab maps into the counted ids


def test_vllm_loader_fills_every_parameter_and_scatters_logits(saved):
    d, path = saved
    sd = load_file(str(path / "model.safetensors"))
    _, vl = _shapes(d.config)
    filled = vllm_load(sd, vl)
    _check_fused(filled, vl, d.config)
    assert not any(k.startswith("model.") for k in sd)  # vLLM would make model.model.*
    # compute_logits: scatter draft logits into the target vocab with d2t
    logits = torch.randn(3, 64)
    full = torch.full((3, d.config.vocab_size), float("-inf"))
    full[:, torch.arange(64) + sd["d2t"]] = logits
    from tidespec.models.runner import DraftRunner
    r = DraftRunner(d)
    assert torch.equal(full.argmax(-1), r.to_target_ids(logits.argmax(-1)))


def test_config_fields_for_both_engines(saved):
    d, path = saved
    cfg = json.loads((path / "config.json").read_text())
    c = d.config
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_act"] == "silu" and cfg["tie_word_embeddings"] is False
    assert cfg["draft_vocab_size"] == 64 and cfg["vocab_size"] == c.vocab_size
    assert cfg["target_hidden_size"] == c.hidden_size == cfg["hidden_size"]
    for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
              "rope_theta", "max_position_embeddings"):
        assert cfg[k] == getattr(c, k), k
    # aux ids: SGLang reads the nested output-of-layer ids, vLLM the top-level input-of-layer ids (+1)
    nested = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert nested == list(c.aux_layer_ids) and cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in nested]
    assert cfg["eagle_config"]["use_aux_hidden_state"] is True
    assert "norm_before_residual" not in cfg  # vLLM default False = SpecForge/SGLang semantics


def test_prefixed_or_extra_keys_are_caught(saved):
    """The emulated loaders do fail where the engines would misbehave (so the tests above can fail)."""
    d, path = saved
    sd = load_file(str(path / "model.safetensors"))
    sg, vl = _shapes(d.config)
    with pytest.raises(KeyError):
        vllm_load({"model." + k if k.startswith("midlayer") else k: v for k, v in sd.items()}, vl)
    _, _, ignored = sglang_load({**sd, "midlayer.self_attn.q_norm.weight": torch.ones(4)}, sg)
    assert ignored == ["midlayer.self_attn.q_norm.weight"]
