"""SGLang adapter: launch arguments, availability, process lifecycle, the /generate capture protocol.

SGLang cannot run here (CUDA-only kernels; its own torch pin), so:
- argument building and validation are checked against the 0.5.23 flag set (engine/sglang.py doc);
- the capture/serve client talks to `_sglang_double`, a FastAPI app speaking SGLang's /generate
  contract as 0.5.23 documents it (meta_info.hidden_states = [prefill rows, one row per decoded
  token], output_ids top level) over our tiny target — the test is that the adapter's record equals
  the embedded engine's record for the same request;
- the process lifecycle runs a stand-in interpreter (`fake-python`) that answers the availability
  probe and serves /health_generate, so start/ready/stop and the early-exit error are real processes;
- `test_real_sglang_*` (marked gpu) runs the real server when a CUDA SGLang env is given in
  $TIDESPEC_SGLANG_PYTHON.
"""
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tidespec.adapters import sglang as sg
from tidespec.config import CaptureParams, EngineParams

ROOT = Path(__file__).resolve().parents[1]


# -- arguments ------------------------------------------------------------------------------------------
def test_serve_args_eagle3():
    cfg = sg.SGLangLaunch("/m/target", python="/env/bin/python", port=31000, draft_path="/m/draft", num_steps=3)
    assert sg.launch_args(cfg) == [
        "/env/bin/python", "-m", "sglang.launch_server", "--model-path", "/m/target", "--host", "127.0.0.1",
        "--port", "31000", "--tp-size", "1", "--dtype", "auto", "--enable-metrics",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/m/draft",
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]
    tree = sg.launch_args(sg.SGLangLaunch("/m", draft_path="/d", num_steps=5, eagle_topk=4, num_draft_tokens=8))
    assert tree[tree.index("--speculative-eagle-topk") + 1] == "4"
    assert tree[tree.index("--speculative-num-draft-tokens") + 1] == "8"
    plain = sg.launch_args(sg.SGLangLaunch("/m", mem_fraction_static=0.8, extra_args=("--log-level", "warning")))
    assert "--speculative-algorithm" not in plain and "--enable-metrics" in plain
    assert plain[-2:] == ["--log-level", "warning"]
    assert plain[plain.index("--mem-fraction-static") + 1] == "0.8"


def test_capture_args_and_layer_ids():
    aux = sg.launch_args(sg.SGLangLaunch("/m", mode="capture_aux", aux_layer_ids=(1, 14, 26), capture_max_len=2048))
    i = aux.index("--return-aux-hidden-state-layer-ids")
    assert aux[i + 1:i + 4] == ["1", "14", "26"]  # output-of-layer ids pass through (SGLang adds the +1)
    for flag in ("--enable-return-aux-hidden-states", "--disable-radix-cache"):
        assert flag in aux
    assert aux[aux.index("--speculative-algorithm") + 1] == "EAGLE3"  # names the convention only
    assert aux[aux.index("--chunked-prefill-size") + 1] == "2048"
    assert "--speculative-draft-model-path" not in aux and "--enable-metrics" not in aux
    last = sg.launch_args(sg.SGLangLaunch("/m", mode="capture_last"))
    assert "--enable-return-hidden-states" in last and "--enable-return-aux-hidden-states" not in last
    assert sg.check_aux_ids([1, 14, 26], 30) == (1, 14, 26)  # SmolLM2 defaults (L=30)
    for bad, msg in [((1, 14, 29), "outputs of layers 0..28"), ((14, 1, 26), "distinct ascending"),
                     ((1, 1, 26), "distinct ascending"), ((1, 14), "3 distinct")]:
        with pytest.raises(ValueError, match=msg):
            sg.check_aux_ids(bad, 30)
    with pytest.raises(ValueError, match="first is 1"):
        sg.check_aux_ids((2, 14, 26), 30, "DeepseekV2ForCausalLM")
    for cfg, msg in [(sg.SGLangLaunch("/m", mode="capture_aux"), "needs aux_layer_ids"),
                     (sg.SGLangLaunch("/m", mode="capture_last", draft_path="/d"), "target alone"),
                     (sg.SGLangLaunch("/m", draft_path="/d", num_steps=3, num_draft_tokens=6), "num_steps \\+ 1"),
                     (sg.SGLangLaunch("/m", draft_path="/d", eagle_topk=4), "needs num_draft_tokens")]:
        with pytest.raises(ValueError, match=msg):
            sg.launch_args(cfg)


def test_unavailable_names_the_fix(tmp_path):
    assert "no usable Python at" in sg.unavailable_reason(str(tmp_path / "nope" / "python"))
    if sg.unavailable_reason(sys.executable) is not None:  # this venv: no sglang (or no CUDA)
        r = sg.unavailable_reason(sys.executable)
        assert "cannot import sglang" in r or "needs a CUDA GPU" in r
        with pytest.raises(sg.SGLangUnavailable, match="tidespec serve"):
            sg.SGLangServer(sg.SGLangLaunch("/m", python=sys.executable), tmp_path / "log").start()


# -- process lifecycle with a stand-in interpreter -----------------------------------------------------
FAKE = textwrap.dedent('''\
    #!{python}
    # stand-in for an SGLang env's python: answers the probe, serves /health_generate on --port
    import json, sys, os
    if sys.argv[1] == "-c":
        print(json.dumps({{"sglang": "0.5.23", "cuda": True}})); sys.exit(0)
    if os.environ.get("FAKE_FAIL"):
        print("RuntimeError: CUDA out of memory (fake)"); sys.stdout.flush(); sys.exit(3)
    port = int(sys.argv[sys.argv.index("--port") + 1])
    import uvicorn
    from fastapi import FastAPI
    app = FastAPI()
    app.get("/health_generate")(lambda: {{}})
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
    ''')


@pytest.fixture
def fake_python(tmp_path):
    p = tmp_path / "fake-python"
    p.write_text(FAKE.format(python=sys.executable))
    p.chmod(0o755)
    return str(p)


def test_server_starts_waits_and_stops_its_process_group(fake_python, tmp_path):
    from tidespec.adapters.process import free_port
    srv = sg.SGLangServer(sg.SGLangLaunch("/m", python=fake_python, port=free_port()), tmp_path / "sglang.log",
                          ready_timeout_s=60)
    with srv:
        import httpx
        assert httpx.get(f"{srv.cfg.url}/health_generate").status_code == 200
        pid = srv.proc.pid
    assert srv.proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(pid, 0)


def test_probe_and_port_problems_are_reported(tmp_path, fake_python):
    old = tmp_path / "old-python"
    old.write_text(f"#!{sys.executable}\nprint('banner'); print('{{\"sglang\": \"0.4.0\", \"cuda\": true}}')\n")
    old.chmod(0o755)
    assert "older than 0.5.23" in sg.unavailable_reason(str(old))
    noisy = tmp_path / "noisy-python"
    noisy.write_text(f"#!{sys.executable}\nprint('no json here')\n")
    noisy.chmod(0o755)
    assert "without the expected JSON" in sg.unavailable_reason(str(noisy))
    assert "no usable Python" in sg.unavailable_reason(str(tmp_path))  # a directory
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(sg.SGLangError, match=f"port {port} .* is in use"):
            sg.SGLangServer(sg.SGLangLaunch("/m", python=fake_python, port=port), tmp_path / "x.log").start()
    for bad, msg in [(dict(mode="capture"), "one of serve"), (dict(port=0), "port"),
                     (dict(mem_fraction_static=1.5), "mem_fraction_static"),
                     (dict(num_steps=3, num_draft_tokens=2), "num_draft_tokens 2")]:
        with pytest.raises(ValueError, match=msg):
            sg.SGLangLaunch("/m", **bad)
    assert sg.SGLangLaunch("/m", host="::1", port=9).url == "http://[::1]:9"


def test_server_that_dies_reports_its_log(fake_python, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_FAIL", "1")
    from tidespec.adapters.process import free_port
    with pytest.raises(sg.SGLangError, match="(?s)exited with 3.*CUDA out of memory"):
        sg.SGLangServer(sg.SGLangLaunch("/m", python=fake_python, port=free_port()), tmp_path / "l.log",
                        ready_timeout_s=60).start()


# -- the /generate contract ----------------------------------------------------------------------------
def _sglang_double(target, mode: str, drop_rows: int = 0):
    """SGLang's /generate reply shape (0.5.23) computed by our target: greedy output_ids; with
    return_hidden_states, meta_info.hidden_states = [prefill rows (aux 3H or final H), then a row per
    decoded token]; `drop_rows` emulates a radix-cache hit (leading rows missing)."""
    from fastapi import FastAPI

    from tidespec.engine.speculative import Engine
    eng = Engine(target, None, EngineParams(num_draft_tokens=3, max_seq_len=256))
    app = FastAPI()
    app.get("/health")(lambda: {})

    @app.post("/generate")
    def generate(body: dict):
        ids = body["input_ids"]
        n = body["sampling_params"]["max_new_tokens"]
        g = eng.generate(ids, n, speculative=False)
        meta = {"id": "x", "finish_reason": {"type": "length"}, "prompt_tokens": len(ids),
                "completion_tokens": len(g.tokens)}
        if body.get("return_hidden_states"):
            with torch.no_grad():
                out = target.forward(torch.tensor(ids), target.new_cache(len(ids)))
            rows = (out.aux if mode == "aux" else out.hidden)[drop_rows:]
            meta["hidden_states"] = [rows.tolist()]
        else:
            meta |= {"spec_accept_length": 1.0, "spec_verify_ct": len(g.tokens)}
        return {"text": "", "output_ids": g.tokens, "meta_info": meta}
    return app


@pytest.fixture(scope="module")
def doubles(tiny_target):
    from tidespec.bench.serve import serve_in_thread
    srv = {m: serve_in_thread(_sglang_double(tiny_target, m)) for m in ("serve", "aux", "last")}
    srv["radix"] = serve_in_thread(_sglang_double(tiny_target, "aux", drop_rows=4))
    yield {k: v.url for k, v in srv.items()}
    for v in srv.values():
        v.stop()


def test_capture_record_equals_the_embedded_engines(tiny_target, doubles):
    from tidespec.capture.store import validate_record
    from tidespec.engine.speculative import Engine
    prompt = [5, 17, 42, 99, 7, 3, 250, 11]
    res, rec = sg.serve_and_capture(doubles["serve"], doubles["aux"], doubles["last"], prompt, 12,
                                    tiny_target.cfg.hidden_size)
    ref = Engine(tiny_target, None, EngineParams(num_draft_tokens=3, max_seq_len=256)).generate(
        prompt, 12, speculative=False, capture=True
    )
    assert res.output_ids == ref.tokens and res.acceptance_length == 1.0
    validate_record(rec)
    assert torch.equal(rec["input_ids"], ref.record["input_ids"])
    assert torch.equal(rec["loss_mask"], ref.record["loss_mask"])
    for k in ("aux_hidden_states", "hidden_states"):
        a, b = rec[k].float(), ref.record[k].float()
        assert a.shape == b.shape
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-2), (k, (a - b).abs().max())


def test_sglang_capture_lands_in_a_snapshot(tiny_target, doubles, tmp_path):
    from tidespec.capture.store import iter_records
    from tidespec.capture.writer import CaptureWriter
    w = CaptureWriter(tmp_path / "capture", tiny_target.target_id, CaptureParams(shard_max_records=2))
    for i, prompt in enumerate(([5, 6, 7, 8], [9, 10, 11, 12, 13])):
        res, rec = sg.serve_and_capture(doubles["serve"], doubles["aux"], doubles["last"], prompt, 6,
                                        tiny_target.cfg.hidden_size)
        assert sg.submit_capture(w, res, rec, f"req-{i}", workload="code")
    w.close()
    rows = list(iter_records(tmp_path / "capture"))
    assert [r[0].request_id for r in rows] == ["req-0", "req-1"]
    assert rows[0][0].workload == "code" and rows[0][0].acceptance_length == 1.0
    assert rows[1][1]["input_ids"].tolist()[:5] == [9, 10, 11, 12, 13]


def test_missing_rows_are_refused_with_the_fix(tiny_target, doubles):
    with pytest.raises(sg.SGLangError, match="--disable-radix-cache"):
        sg.capture_record(doubles["radix"], doubles["last"], [5, 6, 7, 8, 9, 10], [0, 0, 0, 1, 1, 1],
                          tiny_target.cfg.hidden_size)
    with pytest.raises(sg.SGLangError, match="no hidden_states"):
        sg.prefill_rows({}, 3, 8)
    with pytest.raises(ValueError, match="loss_mask has 2 entries for 3 tokens"):
        sg.capture_record(doubles["aux"], doubles["last"], [5, 6, 7], [0, 1], tiny_target.cfg.hidden_size)


# -- real SGLang (GPU machine with an SGLang env) --------------------------------------------------------
SGLANG_PY = os.environ.get("TIDESPEC_SGLANG_PYTHON", "python")


@pytest.mark.gpu
@pytest.mark.skipif(sg.unavailable_reason(SGLANG_PY) is not None, reason="needs CUDA + an SGLang 0.5.23 env "
                                                                         "($TIDESPEC_SGLANG_PYTHON)")
def test_real_sglang_serves_losslessly_and_captures(tmp_path, real_target):
    """SmolLM2 (HF dir converted from the GGUF) + a draft: SGLang's greedy output equals our target-only
    output; its capture record matches the embedded engine's within bf16 noise."""
    from conftest import random_draft
    from tidespec.adapters.process import free_port
    from tidespec.engine.speculative import Engine
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.models.load import target_dir
    target, tok = real_target
    hf = Path(target_dir("smollm2"))  # the GGUF dequantised once into an HF dir
    champion = ROOT / "data/drafts/champion"
    draft = champion if champion.exists() else save_checkpoint(random_draft(target, vd=4096), tmp_path / "draft")
    common = dict(python=SGLANG_PY, dtype="float32")
    cfgs = {"serve": sg.SGLangLaunch(str(hf), port=free_port(), draft_path=str(draft), num_steps=4, **common),
            "aux": sg.SGLangLaunch(str(hf), mode="capture_aux", port=free_port(), aux_layer_ids=target.aux_layers,
                                   mem_fraction_static=0.2, **common),
            "last": sg.SGLangLaunch(str(hf), mode="capture_last", port=free_port(), mem_fraction_static=0.2,
                                    **common)}
    servers = [sg.SGLangServer(c, tmp_path / f"{k}.log").start() for k, c in cfgs.items()]
    try:
        eng = Engine(target, None, EngineParams(num_draft_tokens=4, max_seq_len=1024))
        for text in ("def fibonacci(n):", "Write a haiku about the sea."):
            ids = tok(text)["input_ids"]
            res, rec = sg.serve_and_capture(cfgs["serve"].url, cfgs["aux"].url, cfgs["last"].url, ids, 48,
                                            target.cfg.hidden_size)
            ref = eng.generate(ids, 48, speculative=False, capture=True)
            assert res.output_ids == ref.tokens
            assert res.acceptance_length is not None and res.acceptance_length >= 1.0
            for k in ("aux_hidden_states", "hidden_states"):
                a, b = rec[k].float(), ref.record[k].float()
                assert ((a - b).norm() / b.norm()).item() < 0.05, k
    finally:
        for s in servers:
            s.stop()
