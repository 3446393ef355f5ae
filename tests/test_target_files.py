"""A target's files: a Llama directory of safetensors is read as stored (no HF model built, transformers'
modeling not imported) and gives the target `from_pretrained` gives, tied or not, in one file or shards;
a checkpoint `from_pretrained` treats on its own goes through it, one whose tensors or settings the forward
cannot run is refused by name; a tokenizer saved with the generic fast class is the one AutoTokenizer builds."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import add_tiny_word_tokenizer, make_tiny_target
from tidespec.models.target import Target, load_hf, load_target, target_id_for


def _same_as_from_pretrained(path, tok_none: bool = True) -> Target:
    new, tok = load_target(path)
    model, _ = load_hf(path)
    old = Target.from_hf(model, target_id=target_id_for(path, None))
    assert (tok is None) == tok_none and new.cfg == old.cfg and new.target_id == old.target_id
    assert torch.equal(new.lm_head_weight, old.lm_head_weight) and torch.equal(new.embed, old.embed)
    ids = torch.arange(5, 45)
    a, b = new.forward(ids, new.new_cache(64)), old.forward(ids, old.new_cache(64))
    assert torch.equal(a.logits, b.logits) and torch.equal(a.aux, b.aux)  # the same weights, bit for bit
    return new


def test_a_llama_dir_is_read_without_building_an_hf_model(tiny_target_dir):
    new = _same_as_from_pretrained(tiny_target_dir)
    assert new.lm_head_weight.data_ptr() == new.embed.data_ptr()  # tied: one copy
    code = ("import sys; from tidespec.models.target import load_target; load_target(sys.argv[1]); "
            "print(sorted(m for m in sys.modules if m.startswith('transformers')))")
    r = subprocess.run([sys.executable, "-c", code, str(tiny_target_dir)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_untied_sharded_and_older_configs_read_as_from_pretrained(tmp_path):
    d = make_tiny_target(tmp_path / "untied", seed=3, tie_word_embeddings=False)
    new = _same_as_from_pretrained(d)
    assert new.lm_head_weight.data_ptr() != new.embed.data_ptr()
    w = load_file(str(d / "model.safetensors"))  # two shards and their index, as save_pretrained writes a big one
    keys = sorted(w)
    shards = {"model-00001-of-00002.safetensors": keys[:20], "model-00002-of-00002.safetensors": keys[20:]}
    for name, part in shards.items():
        save_file({k: w[k] for k in part}, str(d / name), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, part in shards.items() for k in part}}))
    (d / "model.safetensors").unlink()
    assert torch.equal(load_target(d)[0].lm_head_weight, new.lm_head_weight)

    cfg = json.loads((d / "config.json").read_text())  # transformers 4's spelling of the RoPE base
    theta = cfg.pop("rope_parameters")["rope_theta"] * 2
    (d / "config.json").write_text(json.dumps(cfg | {"rope_theta": theta, "rope_scaling": None}))
    assert load_target(d)[0].cfg.rope_theta == theta
    (d / "config.json").write_text(json.dumps(cfg | {"rope_scaling": {"type": "linear", "factor": 2.0}}))
    with pytest.raises(NotImplementedError, match="rope_type 'linear'"):
        load_target(d)


def test_an_untied_checkpoint_without_its_output_projection_is_refused(tmp_path):
    d = make_tiny_target(tmp_path / "t", seed=4, tie_word_embeddings=False)
    w = load_file(str(d / "model.safetensors"))
    save_file({k: v for k, v in w.items() if k != "lm_head.weight"}, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"tie_word_embeddings false \(or leaves it out: false\) but the "
                                         "safetensors hold no lm_head.weight"):
        load_target(d)
    _edit_config(d, tie_word_embeddings=None)  # left out: LlamaConfig's default, untied (transformers would
    with pytest.raises(ValueError, match="no lm_head.weight"):  # initialise a random output projection)
        load_target(d)


def test_a_generic_fast_tokenizer_is_the_one_autotokenizer_builds(tmp_path):
    from transformers import AutoTokenizer

    from tidespec.models.hf_files import load_tokenizer
    d = add_tiny_word_tokenizer(make_tiny_target(tmp_path / "t"))
    auto, fast = AutoTokenizer.from_pretrained(d), load_tokenizer(d)
    msgs = [{"role": "system", "content": "t3 t4"}, {"role": "user", "content": "t7 t9 t11"}]
    def seen(t):
        return (type(t), t.encode("t7 t9 t11"), t.apply_chat_template(msgs, add_generation_prompt=True),
                t.eos_token_id, t.all_special_ids, t.chat_template, len(t), t.decode(list(range(30))))
    assert seen(fast) == seen(auto) and fast.eos_token_id is not None


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))


def test_keys_left_out_take_llamaconfigs_defaults_as_from_pretrained(tmp_path):
    d = make_tiny_target(tmp_path / "t", seed=5, tie_word_embeddings=False)
    _edit_config(d, tie_word_embeddings=None, rms_norm_eps=None, rope_parameters=None, head_dim=None,
                 max_position_embeddings=None, bos_token_id=None, eos_token_id=None)
    new = _same_as_from_pretrained(d)
    assert (new.cfg.rms_norm_eps, new.cfg.rope_theta, new.cfg.max_position, new.cfg.eos_token_ids) == (
        1e-6, 10000.0, 2048, (2,))
    assert new.lm_head_weight.data_ptr() != new.embed.data_ptr()  # untied, as LlamaConfig's default


def test_what_from_pretrained_treats_on_its_own_goes_through_it(tmp_path, monkeypatch):
    from tidespec.models import hf_files
    d = make_tiny_target(tmp_path / "t", seed=6)
    w = load_file(str(d / "model.safetensors"))
    save_file(w | {"lm_head.weight": w["model.embed_tokens.weight"] * 2}, str(d / "model.safetensors"))
    _same_as_from_pretrained(d)  # tied, with a head of its own stored: as transformers resolves it
    save_file(w, str(d / "model.safetensors"))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "other.safetensors"}}))
    _same_as_from_pretrained(d)  # model.safetensors wins over an index, as in from_pretrained
    (d / "model.safetensors.index.json").unlink()
    monkeypatch.setattr(hf_files, "load_hf", lambda *a, **k: pytest.fail("through from_pretrained"))
    load_target(d)  # a plain checkpoint is read as stored
    for change in ({"quantization_config": {"quant_method": "fp8"}}, {"model_type": "qwen2"}):
        _edit_config(d, **change)
        with pytest.raises(pytest.fail.Exception, match="through from_pretrained"):
            load_target(d)
        _edit_config(d, **{k: None for k in change} | {"model_type": "llama"})
    save_file({k.removeprefix("model."): v for k, v in w.items()}, str(d / "model.safetensors"))  # a bare LlamaModel
    with pytest.raises(pytest.fail.Exception, match="through from_pretrained"):
        load_target(d)


def test_weights_or_settings_the_forward_cannot_run_are_refused_by_name(tmp_path):
    d = make_tiny_target(tmp_path / "t", seed=7)
    _edit_config(d, num_key_value_heads=4)
    with pytest.raises(ValueError, match=r"k_proj.weight is \(32, 64\), config.json makes it \(64, 64\)"):
        load_target(d)
    _edit_config(d, num_key_value_heads=2, attention_bias=True)
    with pytest.raises(NotImplementedError, match="attention_bias"):
        load_target(d)
    _edit_config(d, attention_bias=False, hidden_act="gelu")
    with pytest.raises(NotImplementedError, match="hidden_act"):
        load_target(d)
