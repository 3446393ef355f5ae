"""The train step as torchrun ranks on CPU (gloo, one thread each): the cycle's own train route
(`cycle.train_candidate` with train.nproc_per_node: 2) starts torchrun, the ranks split every
global batch, and the weights equal one process's at the same global batches; a rank killed
mid-run is restarted by torchrun from the last training state, to the same result."""
import os
import signal
import threading
import time

import psutil
import pytest
import torch
from safetensors.torch import load_file

from conftest import make_tiny_workspace
from tidespec.train.resume import state_dir

# fp32 sums of the same terms in another order (a rank's partial sums, then their sum) differ
# by ≤ n·u relatively, n the terms summed (≤ 2,048 here: rows × vocab entries of one loss) and
# u = 2^-24: δ ≤ 1.2e-4. AdamW's step lr·m̂/(√v̂+ε) is invariant to the gradient's scale, so a
# relative error δ in g moves it by ≤ 2δ·lr (m̂ and √v̂ each off by ≤ δ); over S steps the
# weights part by ≤ 2·S·δ·lr. A rank whose gradient is lost or counted twice is off by ~lr per step.
DELTA = 1.2e-4


def _workspace(tmp_path, tiny_target_dir):
    from tidespec.steps.cycle import step_curate
    ws, params, target = make_tiny_workspace(tmp_path, tiny_target_dir, n_requests=16)
    step_curate(ws, params, target.target_id)
    return ws, params


def _train(ws, params, out, **train):
    from tidespec.steps.cycle import train_candidate
    p = params.model_copy(update={"train": params.train.model_copy(update=train)})
    return train_candidate(ws, p, ws.curated, None, ws.work / out)


def _weights(ws, out):
    return load_file(ws.work / out / "model.safetensors")


def test_two_ranks_give_one_rank_weights(tmp_path, tiny_target_dir):
    ws, params = _workspace(tmp_path, tiny_target_dir)
    m1 = _train(ws, params, "one", batch_tokens=96, epochs=4)
    m2 = _train(ws, params, "two", batch_tokens=96, epochs=4, nproc_per_node=2)
    assert (m1["train_world_size"], m2["train_world_size"]) == (1, 2)
    assert m2["train_tokens"] == m1["train_tokens"] and m2["train_steps"] == m1["train_steps"] >= 8
    w1, w2 = _weights(ws, "one"), _weights(ws, "two")
    bound = 2 * m1["train_steps"] * DELTA * params.train.lr
    for k in w1:
        if not w1[k].is_floating_point():
            assert torch.equal(w1[k], w2[k]), k  # d2t / t2d: the same draft vocabulary
            continue
        assert float((w1[k] - w2[k]).abs().max()) <= bound, k
    torch.testing.assert_close(torch.tensor(m2["train/loss"]), torch.tensor(m1["train/loss"]), rtol=1e-5, atol=0)
    assert m1["simulated_acceptance_length"] == pytest.approx(m2["simulated_acceptance_length"], abs=1e-6)


def _kill_a_rank(state, spec, deadline_s: float = 120.0) -> int:
    """SIGKILL rank 1 of the run on `spec` (this test's ranks only) once the training state
    exists; returns the killed pid."""
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        if state.exists():
            for p in psutil.process_iter(["cmdline", "pid"]):
                cmd = " ".join(p.info["cmdline"] or [])
                if f"tidespec.steps.rank {spec}" in cmd and "torch.distributed.run" not in cmd:
                    try:
                        if p.environ().get("RANK") == "1":
                            os.kill(p.pid, signal.SIGKILL)
                            return p.pid
                    except psutil.Error:
                        continue
        time.sleep(0.05)
    raise AssertionError("no training state or rank 1 to kill")


def test_killed_rank_restarts_from_the_last_state(tmp_path, tiny_target_dir):
    ws, params = _workspace(tmp_path, tiny_target_dir)
    kw = dict(batch_tokens=128, epochs=30, checkpoint_every=1, nproc_per_node=2)
    ref = _train(ws, params, "ref", **kw)
    got = {}
    t = threading.Thread(target=lambda: got.update(_train(ws, params, "cut", max_restarts=1, **kw)))
    t.start()
    assert _kill_a_rank(state_dir(ws.work / "cut") / "state.pt", (ws.work / "cut.ranks.json").resolve()) > 0
    t.join(300)
    assert not t.is_alive() and got, "the restarted ranks did not finish"
    assert 0 < got["resumed_from_step"] < ref["train_steps"] == got["train_steps"]
    assert "restart" in (ws.work / "cut.ranks.log").read_text().lower()
    a, b = _weights(ws, "ref"), _weights(ws, "cut")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)  # same ranks, same sums: bit-equal
    assert got["train/loss"] == ref["train/loss"]


@pytest.mark.parametrize("bad, names", [
    ({"nnodes": 2}, "train.rdzv_endpoint"),
    ({"rdzv_endpoint": "head:29400"}, "train.nnodes is 1"),
    ({"max_restarts": 2}, "train.nproc_per_node"),
    ({"nproc_per_node": 0}, "nproc_per_node"),
    ({"nnodes": 2, "rdzv_endpoint": "no-port"}, "rdzv_endpoint"),
])
def test_rank_settings_are_checked(bad, names):
    from pydantic import ValidationError

    from tidespec.config import TrainParams
    with pytest.raises(ValidationError, match=names):
        TrainParams(**bad)
    assert TrainParams(nnodes=2, rdzv_endpoint="head:29400", nproc_per_node=8).world_size == 16


def test_torchrun_command_line():
    from pathlib import Path

    from tidespec.adapters import torchrun
    from tidespec.config import TrainParams
    one = torchrun.argv(TrainParams(nproc_per_node=2, max_restarts=1), Path("/s.json"), "r1", port=29555)
    assert one[one.index("--nproc-per-node") + 1] == "2" and one[one.index("--max-restarts") + 1] == "1"
    assert one[one.index("--rdzv-endpoint") + 1] == "127.0.0.1:29555"
    assert one[-3:] == ["-m", torchrun.RANK_MODULE, "/s.json"]
    two = torchrun.argv(TrainParams(nproc_per_node=8, nnodes=2, rdzv_endpoint="head:29400"), Path("/s.json"), "r2")
    assert two[two.index("--nnodes") + 1] == "2" and two[two.index("--rdzv-endpoint") + 1] == "head:29400"
    assert two[two.index("--rdzv-id") + 1] == "r2"
