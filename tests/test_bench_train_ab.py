"""`tidespec bench train-ab`'s arms and refusals (the bench itself runs on the real target: docs/benchmarks.md)."""
import pytest

from conftest import shipped_params
from tidespec.bench.train_ab import _check, parse_arm, parser
from tidespec.config import Params


@pytest.fixture
def params(tiny_target_dir):
    return Params.model_validate(shipped_params(tiny_target_dir))


def test_an_arm_changes_the_train_fields_it_names_and_nothing_else(params):
    name, p = parse_arm("w1:train.rejected_weight=1.5,train.loss=lk", params)
    assert name == "w1" and p.train.rejected_weight == 1.5 and p.train.loss == "lk"
    assert p.model_dump() | {"train": None} == params.model_dump() | {"train": None}
    assert p.train.model_dump() | {"rejected_weight": 0.0, "loss": "kl"} == params.train.model_dump() | {
        "rejected_weight": 0.0, "loss": "kl"}


@pytest.mark.parametrize("spec, match", [
    ("w1", "write NAME:train.FIELD=VALUE"),
    ("base:train.epochs=2", "NAME not 'base'"),
    ("w1:engine.num_draft_tokens=2", "arms differ in train fields only"),
    ("w1:train.nope=1", "train has no field 'nope'"),
    ("w1:train.rejected_weight=-1", "greater than or equal to 0"),
    ("w1:train.loss=lk,train.backend=specforge", "train.loss lk is the embedded trainer's"),
])
def test_a_bad_arm_is_refused_by_name(params, spec, match):
    with pytest.raises(SystemExit, match=match):
        parse_arm(spec, params)


def test_seeds_and_arms_each_once_and_an_existing_warm_start(tmp_path):
    a = parser().parse_args(["--init", str(tmp_path), "--seeds", "0", "0"])
    with pytest.raises(SystemExit, match="each seed once"):
        _check(a, ["base"])
    a = parser().parse_args(["--init", str(tmp_path)])
    with pytest.raises(SystemExit, match="each once"):
        _check(a, ["base", "w1", "w1"])
    with pytest.raises(SystemExit, match="no such draft"):
        _check(parser().parse_args(["--init", str(tmp_path / "none")]), ["base"])
    with pytest.raises(SystemExit, match="--prompts"):
        _check(parser().parse_args(["--init", str(tmp_path), "--prompts", "0"]), ["base"])
    _check(a, ["base", "w1"])


def test_traffic_a_draft_serves_is_captured_with_where_it_was_rejected(tmp_path, tiny_target):
    """`serve_and_capture` with a draft: speculative chains of k, each record's manifest row lists the
    rejected positions (a random draft is rejected at nearly every step); target-only: none."""
    import torch

    from conftest import random_draft
    from tidespec.bench.train import serve_and_capture
    from tidespec.capture.store import read_manifest
    from tidespec.models.runner import DraftRunner

    g = torch.Generator().manual_seed(0)
    prompts = [(f"p{i}", torch.randint(3, 320, (6,), generator=g).tolist()) for i in range(3)]
    spec = serve_and_capture(tiny_target, prompts, 16, tmp_path / "spec", "code",
                             draft=DraftRunner(random_draft(tiny_target)), k=3)
    plain = serve_and_capture(tiny_target, prompts, 16, tmp_path / "plain", "code")
    assert spec["outputs"] == plain["outputs"] and plain["acceptance_length"] == 1.0
    rows = read_manifest(tmp_path / "spec")
    assert len(rows) == 3 and all(r.rejected and min(r.rejected) >= 6 for r in rows)
    assert all(r.rejected is None for r in read_manifest(tmp_path / "plain"))
