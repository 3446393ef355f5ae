"""The global suffix tree a cycle deploys with its draft: built from the curated window's outputs,
stored beside the checkpoint, installed by the server's hot-swap (promotion and rollback move it
with the draft: tests/test_promotion.py)."""
import json

import pytest
from fastapi.testclient import TestClient

from conftest import make_tiny_workspace, random_draft
from tidespec.config import EngineParams
from tidespec.engine.speculative import Engine
from tidespec.engine.suffix_tree import CORPUS_FILE, SuffixCache, corpus_info, load_corpus, save_corpus


def test_corpus_roundtrip_budget_and_malformed_files(tmp_path):
    seqs = [[5, 6, 7], [], [8, 9, 10, 11], [12]]
    assert save_corpus(tmp_path / "c.safetensors", seqs) == {"sequences": 4, "tokens": 8}
    assert load_corpus(tmp_path / "c.safetensors") == seqs
    assert corpus_info(tmp_path / "c.safetensors") == {"sequences": 4, "tokens": 8}
    cache = SuffixCache(max_depth=4, max_tokens=5)
    trie, kept, n = cache.build_global(seqs)
    assert list(kept) == [[8, 9, 10, 11], [12]] and n == 5  # the newest within the budget, oldest first
    (tmp_path / "bad.safetensors").write_bytes(b"not safetensors")
    for f in (corpus_info, load_corpus):
        with pytest.raises(ValueError, match="not a suffix corpus"):
            f(tmp_path / "bad.safetensors")
    import torch
    from safetensors.torch import save_file
    save_file({"tokens": torch.tensor([1, 2], dtype=torch.int32), "offsets": torch.tensor([0, 5])},
              str(tmp_path / "off.safetensors"))
    with pytest.raises(ValueError, match="offsets"):
        load_corpus(tmp_path / "off.safetensors")


def test_engine_installs_a_corpus_and_proposes_from_it(tiny_target):
    eng = Engine(
        tiny_target,
        None,
        EngineParams(num_draft_tokens=3, max_seq_len=256),
        suffix=SuffixCache(max_depth=8, max_tokens=100),
    )
    ref = Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256)).generate([77, 78], 16).tokens
    assert eng.set_suffix_corpus([[1, 2, 3], [77, 78] + ref]) == 3 + 2 + len(ref)
    g = eng.generate([77, 78], 16)
    assert g.tokens == ref and g.by_proposer["suffix"].num_accepted_tokens >= 12  # it knew the answer
    with pytest.raises(ValueError, match="engine.suffix.enabled"):
        Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256)).set_suffix_corpus([[1, 2]])


def test_cycle_corpus_is_the_curated_windows_outputs(tmp_path, tiny_target_dir):
    from tidespec.capture import curate
    from tidespec.steps import cycle
    ws, params, target = make_tiny_workspace(tmp_path, tiny_target_dir, n_requests=12)
    cycle.step_curate(ws, params, target.target_id)
    idx = json.loads(ws.curated.read_text())
    seqs = curate.output_sequences(ws.curated)
    assert len(seqs) == len(idx["train"]) + len(idx["val"]) and all(len(s) == 23 for s in seqs)  # 24 generated - 1
    holdout = {
        tuple(json.loads(x)["input_ids"]) for x in (ws.curated.parent / "holdout.jsonl").read_text().splitlines()
    }
    assert holdout  # evaluation prompts exist, and their outputs are not in the corpus
    out = tmp_path / "cand"
    out.mkdir()
    m = curate.write_suffix_corpus(ws.curated, out, max_tokens=50)
    assert m == {"suffix_corpus/sequences": 2, "suffix_corpus/tokens": 46}  # the newest two fit 50 tokens
    assert load_corpus(out / CORPUS_FILE) == seqs[-2:]


def test_server_swap_installs_the_drafts_corpus(tiny_target, tmp_path):
    from tidespec.config import ServeParams
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.models.runner import DraftRunner
    from tidespec.serve.server import build_app

    drafts = tmp_path / "drafts"
    save_checkpoint(random_draft(tiny_target, 64, seed=1), drafts / "v1")
    save_checkpoint(random_draft(tiny_target, 64, seed=2), drafts / "v2")
    save_corpus(drafts / "v2" / CORPUS_FILE, [[5, 6, 7, 8], [9, 10]])
    (drafts / "v3").mkdir()
    save_checkpoint(random_draft(tiny_target, 64, seed=3), drafts / "v3")
    (drafts / "v3" / CORPUS_FILE).write_bytes(b"garbage")
    eng = Engine(
        tiny_target,
        DraftRunner(random_draft(tiny_target, 64, seed=1)),
        EngineParams(num_draft_tokens=3, max_seq_len=256),
        suffix=SuffixCache(max_depth=8),
        draft_version="v1",
    )
    ok = {"Authorization": "Bearer s3cret"}
    with TestClient(build_app(eng, None, ServeParams(max_tokens=16), drafts_dir=drafts, admin_token="s3cret")) as c:
        r = c.post("/admin/draft", json={"path": "v2"}, headers=ok)
        assert r.json() == {"draft_version": "v2", "suffix_corpus_tokens": 6, "pinned": True}
        assert eng.suffix.retained_tokens == 6
        r = c.post("/admin/draft", json={"path": "v3"}, headers=ok)  # a corrupt corpus: draft swapped, tree kept
        assert r.json() == {"draft_version": "v3", "suffix_corpus_tokens": None, "pinned": True}
        assert eng.suffix.retained_tokens == 6
        r = c.post("/admin/draft", json={"path": "v1"}, headers=ok)  # no corpus: the live tree keeps serving
        assert r.json()["suffix_corpus_tokens"] is None and eng.suffix.retained_tokens == 6


def test_reload_with_a_corrupt_corpus_swaps_the_draft_and_keeps_the_live_tree(tiny_target, tmp_path):
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.steps.deploy.local import reload_if_changed
    from tidespec.workspace import write_version
    d = tmp_path / "champion"
    save_checkpoint(random_draft(tiny_target, 64, seed=2), d)
    write_version(d, "7", "run")
    (d / CORPUS_FILE).write_bytes(b"garbage")
    eng = Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256), suffix=SuffixCache(max_depth=8))
    eng.set_suffix_corpus([[5, 6, 7]])
    assert reload_if_changed(eng, d) and eng.draft_version == "7" and eng.suffix.retained_tokens == 3
