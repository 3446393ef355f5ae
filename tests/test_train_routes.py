"""The three train routes (the flow's train task, `tidespec stage train` = what `dvc repro` runs, the
`tide-train` deployment's flow) call the one entry, `cycle.train_candidate`, with the same arguments;
only the pool's own run trains here (`here=True`). The flows come from the project's flows/, loaded
as a worker loads them."""
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def calls(monkeypatch):
    from tidespec.steps import cycle
    got = []

    def record(ws, params, curated, init, out, *, params_path=None, here=False, progress=None):
        got.append({"root": ws.root, "curated": Path(curated), "init": init and Path(init), "out": Path(out),
                    "params_path": params_path and Path(params_path).resolve(), "here": here,
                    "lr": params.train.lr})
        return {"train_examples": 1}
    monkeypatch.setattr(cycle, "train_candidate", record)
    return got


def _project(tmp_path):
    (tmp_path / "params.yaml").write_text("train: {lr: 0.0123}\n")
    (tmp_path / "data" / "drafts" / "champion").mkdir(parents=True)
    return tmp_path.resolve()


def test_every_route_calls_train_candidate(tmp_path, calls, monkeypatch):
    from tidespec.adapters.orchestrate import load_flow
    from tidespec.cli.stages import stage_train
    from tidespec.workspace import Workspace

    flow_train_task = load_flow("tide_cycle", REPO).fn.__globals__["train"]  # flows/cycle.py's train task
    tide_train = load_flow("tide_train", REPO)

    root = _project(tmp_path)
    ws = Workspace(root)
    params = root / "params.yaml"
    monkeypatch.chdir(root)
    stage_train(root=root, params=params)                                   # dvc repro's stage
    flow_train_task.fn(str(root), str(params), str(ws.curated), str(ws.champion))  # tide_cycle's train task
    tide_train.fn(curated=str(ws.curated), out=str(ws.candidate), init=str(ws.champion), root=str(root),
                  params_path=str(params))                                  # the tide-train deployment's run
    assert len(calls) == 3
    want = {"root": root, "curated": ws.curated, "init": ws.champion, "out": ws.candidate,
            "params_path": params, "lr": 0.0123}
    for c in calls:
        assert {k: c[k] for k in want} == want
    assert [c["here"] for c in calls] == [False, False, True]  # only the pool's own run trains in place
