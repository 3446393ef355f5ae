"""A target's files: a Llama directory of safetensors is read as stored (no HF model built, transformers'
modeling not imported) and gives the target `from_pretrained` gives, tied or not, in one file or shards;
a checkpoint that cannot be read that way is refused with the key it lacks; a tokenizer saved with the
generic fast class is the one AutoTokenizer builds."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import add_tiny_word_tokenizer, make_tiny_target
from tidespec.models.target import Target, load_hf, load_target, target_id_for


def _same_as_from_pretrained(path) -> Target:
    new, tok = load_target(path)
    model, _ = load_hf(path)
    old = Target.from_hf(model, target_id=target_id_for(path, None))
    assert tok is None and new.cfg == old.cfg and new.target_id == old.target_id
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
    with pytest.raises(ValueError, match="tie_word_embeddings false but the safetensors hold no lm_head.weight"):
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
