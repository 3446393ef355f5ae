"""SGLang adapter: launch arguments, availability, process lifecycle, the /generate capture protocol.

SGLang cannot run here (CUDA-only kernels; its own torch pin), so:
- argument building and validation are checked against the 0.5.23 flag set (engine/sglang.py doc);
- the capture/serve client talks to `_sglang_double`, a FastAPI app speaking SGLang's /generate
  contract as 0.5.23 documents it (meta_info.hidden_states = [prefill rows, one row per decoded
  token], output_ids top level) over our tiny target — the test is that the adapter's record equals
  the embedded engine's record for the same request;
- the process lifecycle runs a stand-in interpreter (`fake-python`) that answers the availability
  probe and serves /health_generate, so start/ready/stop and the early-exit error are real processes;
- in-place draft swaps, live counters and `tidespec serve --backend sglang` run against a recorded
  SGLang API (`RECORDED`: the 0.5.23 routes' request checks and replies, `sglang/srt/managers/
  io_struct.py` and `entrypoints/http_server.py`; `/server_info` with the fields the swap reads,
  from the stand-in's own flags), served by the same stand-in interpreter, which
  also runs the swap script with a serializer stand-in (`STUB`: torch.save bytes where SGLang's
  sends CUDA IPC handles);
- `test_real_sglang_*` (marked gpu) runs the real server when a CUDA SGLang env is given in
  $TIDESPEC_SGLANG_PYTHON (fp32, to compare with our fp32 target: the triton attention backend).
"""
import json
import os
import shutil
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tidespec.backends import sglang as sg
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
    with pytest.raises(ValueError, match="dtype float32.*--attention-backend"):  # fa3, Hopper's default: fp16/bf16
        sg.launch_args(sg.SGLangLaunch("/m", dtype="float32"))
    fp32 = sg.launch_args(sg.SGLangLaunch("/m", dtype="float32", extra_args=("--attention-backend", "triton")))
    assert fp32[fp32.index("--dtype") + 1] == "float32" and fp32[-2:] == ["--attention-backend", "triton"]


def test_auto_dtype_is_the_targets_for_the_draft_too(tmp_path):
    """SGLang resolves `--dtype auto` for the draft from the draft's own config.json (a tidespec draft
    says float32 → float16), so with a draft `auto` becomes what SGLang gives the target: its config
    dtype, float32 → float16 (Gemma: bfloat16); unreadable config (a hub id) or no draft → auto."""
    def dtype_for(config, draft="/d"):
        (tmp_path / "config.json").write_text(json.dumps(config))
        a = sg.launch_args(sg.SGLangLaunch(str(tmp_path), draft_path=draft))
        return a[a.index("--dtype") + 1]
    assert dtype_for({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert dtype_for({"dtype": "float16"}) == "float16"
    assert dtype_for({"torch_dtype": "float32", "model_type": "llama"}) == "float16"
    assert dtype_for({"model_type": "gemma2"}) == "bfloat16"
    assert dtype_for({"text_config": {"dtype": "bfloat16"}}) == "bfloat16"
    assert dtype_for({"torch_dtype": "bfloat16"}, draft=None) == "auto"
    assert sg.auto_dtype(str(tmp_path / "org/model")) is None
    for odd in ([], {"text_config": "abc"}, "float16"):  # JSON, but not a config: unreadable here, as a hub id
        (tmp_path / "config.json").write_text(json.dumps(odd))
        assert sg.auto_dtype(str(tmp_path)) == (None if not isinstance(odd, dict) else "float16")
    a = sg.launch_args(sg.SGLangLaunch("org/model", draft_path="/d"))
    assert a[a.index("--dtype") + 1] == "auto"


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
    # stand-in for an SGLang env's python: answers the probe, serves the recorded API on --port, runs
    # scripts (the swap script) with the serializer stand-in importable as sglang
    import json, os, runpy, sys
    if sys.argv[1] == "-c":
        print(json.dumps({{"sglang": "0.5.23", "cuda": True}})); sys.exit(0)
    if sys.argv[1] != "-m":
        sys.path.insert(0, {stub!r})
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__"); sys.exit(0)
    if os.environ.get("FAKE_FAIL"):
        print("RuntimeError: CUDA out of memory (fake)"); sys.stdout.flush(); sys.exit(3)
    sys.argv = sys.argv[2:]
    runpy.run_path({recorded!r}, run_name="__main__")
    ''')

RECORDED = textwrap.dedent('''\
    # SGLang 0.5.23's routes as recorded: request checks (io_struct) and replies (http_server);
    # every call is appended to $SGLANG_RECORD as one JSON line
    import base64, io, json, os, sys, threading
    import torch, uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse
    argv, rec = sys.argv, os.environ.get("SGLANG_RECORD")
    st, lock = {"session": None, "paused": False, "verify": 0, "generated": 0, "requests": 0}, threading.Lock()
    def log(entry):
        if rec:
            with lock, open(rec, "a") as f:
                f.write(json.dumps(entry) + "\\n")
    log({"argv": argv})
    app = FastAPI()
    app.get("/health_generate")(lambda: {})
    app.get("/health")(lambda: {})
    def flag(name, default=None):
        return argv[argv.index(name) + 1] if name in argv else default
    @app.get("/server_info")
    async def server_info():  # ServerArgs.resolved_dict() (the fields the swap reads), this server's flags
        log({"path": "/server_info"})
        return {"tp_size": int(flag("--tp-size", 1)), "dp_size": 1, "pp_size": 1, "nnodes": 1,
                "base_gpu_id": int(flag("--base-gpu-id", 0)), "gpu_id_step": int(flag("--gpu-id-step", 1)),
                "device": flag("--device", "cpu"),  # resolved to "cuda" on a GPU server; this one is not
                "speculative_algorithm": flag("--speculative-algorithm"),
                "speculative_draft_model_path": flag("--speculative-draft-model-path"),
                "internal_states": [{}], "version": "0.5.23", "frontend": "python"}
    def bad(msg):
        return JSONResponse({"success": False, "message": msg}, status_code=400)
    @app.post("/v1/completions")
    async def completions(body: dict):
        import asyncio
        while st["paused"]:  # a paused scheduler holds new requests
            await asyncio.sleep(0.01)
        with lock:  # 12 tokens: 1 from the prefill, 11 in 5 verify steps (6 accepted: tau 2.2)
            st["verify"] += 5; st["generated"] += 12; st["requests"] += 1
        return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": body.get("model"),
                "choices": [{"index": 0, "text": " recorded", "logprobs": None, "finish_reason": "length",
                             "matched_stop": None}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}}
    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(
            "# HELP sglang:spec_verify_calls_total Number of speculative decoding verification calls.\\n"
            "# TYPE sglang:spec_verify_calls_total counter\\n"
            f'sglang:spec_verify_calls_total{{model_name="m"}} {st["verify"]}.0\\n'
            "# HELP sglang:generation_tokens_total Number of generation tokens processed.\\n"
            "# TYPE sglang:generation_tokens_total counter\\n"
            f'sglang:generation_tokens_total{{is_streaming="false",model_name="m"}} {st["generated"]}.0\\n'
            "# TYPE sglang:num_requests_total counter\\n"
            f'sglang:num_requests_total{{is_streaming="false",model_name="m"}} {st["requests"]}.0\\n')
    @app.post("/pause_generation")
    async def pause(body: dict):
        log({"path": "/pause_generation", "body": body})
        st["paused"] = body.get("mode", "abort") != "abort"
        return {"message": "Generation paused successfully.", "status": "ok"}
    @app.post("/continue_generation")
    async def resume(body: dict):
        log({"path": "/continue_generation"})
        st["paused"] = False
        return {"message": "Generation continued successfully.", "status": "ok"}
    @app.post("/begin_weight_update")
    async def begin(body: dict):
        log({"path": "/begin_weight_update", "body": body})
        if st["session"] is not None:
            return bad("a weight-update session is already open; call end_weight_update() first")
        if body.get("selector", "all") not in ("target", "draft", "all"):
            return JSONResponse({"detail": "selector"}, status_code=422)
        st["session"] = body.get("selector", "all")
        return {"success": True, "message": "Success"}
    @app.post("/update_weights_from_tensor")
    async def update(body: dict):
        named = [torch.load(io.BytesIO(base64.b64decode(x))) for x in body["serialized_named_tensors"]]
        log({"path": "/update_weights_from_tensor", "selector": body.get("selector", "all"),
             "flush_cache": body.get("flush_cache", True), "session": st["session"], "paused": st["paused"],
             "ranks": [{k: float(v.double().sum()) for k, v in r} for r in named]})
        if st["session"] is None:
            return bad("update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")
        # SGLang flushes only an idle or paused scheduler (FAKE_UPDATE_FAILS: once, as if requests still ran);
        # a loader error is not answered at all: it kills the scheduler (weight_updater.py, no except)
        failing = os.environ.get("FAKE_UPDATE_FAILS") and os.path.exists(os.environ["FAKE_UPDATE_FAILS"])
        if failing:
            os.remove(os.environ["FAKE_UPDATE_FAILS"])
        if body.get("flush_cache", True) and (failing or not st["paused"]):
            return bad("Weights were updated, but the cache was not flushed because requests are still running or "
                       "queued. Retract or finish them, then call /flush_cache.")
        return {"success": True, "message": "Success"}
    @app.post("/end_weight_update")
    async def end(body: dict):
        log({"path": "/end_weight_update"})
        if st["session"] is None:
            return bad("no weight-update session is open; call begin_weight_update() first")
        st["session"] = None
        return {"success": True, "message": "Success"}
    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush():
        log({"path": "/flush_cache"})
        return PlainTextResponse("Cache flushed.\\n")
    uvicorn.run(app, host="127.0.0.1", port=int(argv[argv.index("--port") + 1]), log_level="warning")
    ''')

STUB = {  # sglang's serializer as the swap script imports it; torch.save bytes stand in for CUDA IPC handles
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/utils/__init__.py": "",
    "sglang/srt/utils/patch_torch.py": "def monkey_patch_torch_reductions():\n    pass\n",
    "sglang/srt/utils/common.py": textwrap.dedent('''\
        import base64, io
        import torch
        class MultiprocessingSerializer:
            @staticmethod
            def serialize(obj, output_str=False):
                buf = io.BytesIO(); torch.save(obj, buf)
                return base64.b64encode(buf.getvalue()).decode() if output_str else buf.getvalue()
        '''),
}


@pytest.fixture
def fake_python(tmp_path):
    stub = tmp_path / "stub"
    for rel, text in STUB.items():
        (stub / rel).parent.mkdir(parents=True, exist_ok=True)
        (stub / rel).write_text(text)
    (tmp_path / "recorded_sglang.py").write_text(RECORDED)
    p = tmp_path / "fake-python"
    p.write_text(FAKE.format(python=sys.executable, stub=str(stub), recorded=str(tmp_path / "recorded_sglang.py")))
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


# -- in-place swaps, live counters and the launched backend, against the recorded API ----------------------
def _bundles(tiny_target, tmp_path) -> dict[str, Path]:
    """Registry-style bundles of three drafts of one config: v1, v2 (other weights), v4 (other
    weights and another vocabulary map)."""
    from conftest import random_draft
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.workspace import make_bundle, write_version
    out = {}
    for v, seed in (("1", 1), ("2", 2), ("4", 4)):
        d = random_draft(tiny_target, vd=64, seed=seed)
        if v == "4":
            d.d2t.add_(1)  # every draft id maps one target id further
        out[v] = make_bundle(save_checkpoint(d, tmp_path / f"ck{v}"), tmp_path / f"b{v}")
        write_version(out[v], v, f"run{v}")
    return out


def _calls(record: Path, since: int = 0) -> list[dict]:
    return [json.loads(x) for x in record.read_text().splitlines()[since:]]


def _sums(bundle: Path) -> dict[str, float]:
    from safetensors.torch import load_file
    return {k: float(v.double().sum()) for k, v in load_file(bundle / "draft" / "model.safetensors").items()
            if k not in ("d2t", "t2d")}


def test_in_place_swap_on_sglang_under_load(fake_python, tiny_target, tmp_path, monkeypatch):
    """SGLangDeployment against the recorded API: the draft in v2 goes into the running server through
    SGLang's draft-only update inside a pause (server_info → pause(retract) → begin(draft) →
    update_weights_from_tensor (draft, one payload per TP rank of the server's own tp_size, cache
    flushed while paused) → end → continue) while 3 clients send
    requests through the front door, all answered 200; the payload holds exactly v2's tensors less the
    vocabulary map. A draft with another config or vocabulary map is refused before any call, naming
    why; an update SGLang fails loads the served draft's files again. Live counters are differenced at the swap."""
    from tidespec.adapters.process import free_port
    from tidespec.backends.sglang.deployment import SGLangDeployment
    from tidespec.serve.frontdoor import build_frontdoor
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("SGLANG_RECORD", str(record))
    fails = tmp_path / "fail"  # the recorded server fails the next update once this file exists
    monkeypatch.setenv("FAKE_UPDATE_FAILS", str(fails))
    b = _bundles(tiny_target, tmp_path)
    launch = sg.SGLangLaunch("/m/target", python=fake_python, port=free_port(), num_steps=3, tp_size=2)
    dep = SGLangDeployment(launch, tmp_path / "state", ready_timeout_s=60).start(b["1"])
    try:
        argv = _calls(record)[0]["argv"]
        assert argv[argv.index("--speculative-draft-model-path") + 1].endswith("1-v1")
        assert dep.draft_version == "1" and dep.scrape().num_drafts == 0
        app = build_frontdoor(dep.url, None, 60)
        n0 = len(_calls(record))
        res, statuses = _under_load(app, lambda: dep.install(b["2"]))
        assert res["mode"] == "in_place" and res["draft_version"] == "2" == dep.draft_version and res["flushed"]
        assert len(statuses) >= 6 and set(statuses) == {200}, statuses
        calls = _calls(record, n0)
        assert [c["path"] for c in calls] == ["/server_info", "/pause_generation", "/begin_weight_update",
                                              "/update_weights_from_tensor", "/end_weight_update",
                                              "/continue_generation"]
        assert calls[1]["body"] == {"mode": "retract"} and calls[2]["body"] == {"selector": "draft"}
        up = calls[3]
        assert up["selector"] == "draft" and up["session"] == "draft" and up["flush_cache"] is True and up["paused"]
        assert len(up["ranks"]) == 2 and up["ranks"][0] == up["ranks"][1] == pytest.approx(_sums(b["2"]))
        assert up["ranks"][0] != pytest.approx(_sums(b["1"]))
        assert dep.counters_base.num_drafts > 0  # v1's drafts: v2's own figures start at the swap
        before = dep.scrape() - dep.counters_base
        import httpx
        httpx.post(f"{dep.url}/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 12})
        live = dep.scrape() - dep.counters_base - before
        assert (live.num_drafts, live.num_accepted_tokens, live.num_draft_tokens) == (5, 6, 15)
        assert live.acceptance_length == pytest.approx(2.2)  # the prefill's token is not a verify's

        n0 = len(_calls(record))
        with pytest.raises(sg.SGLangError, match=r"vocabulary map changed \(d2t\).*restart"):
            dep.install(b["4"])
        wide = tmp_path / "b5"
        shutil.copytree(b["2"], wide)
        cfg = json.loads((wide / "draft" / "config.json").read_text())
        (wide / "draft" / "config.json").write_text(json.dumps(cfg | {"draft_vocab_size": 128}))
        with pytest.raises(sg.SGLangError, match="draft_vocab_size 64 → 128"):
            dep.install(wide)
        assert _calls(record, n0) == [] and dep.draft_version == "2"

        fails.touch()
        three = tmp_path / "b3"
        shutil.copytree(b["1"], three)
        (three / "version.json").write_text(json.dumps({"version": "3", "run_id": "r3"}))
        n0 = len(_calls(record))
        with pytest.raises(sg.SGLangError, match="(?s)cache was not flushed.*served draft 2 was loaded again"):
            dep.install(three)
        ups = [c for c in _calls(record, n0) if c["path"] == "/update_weights_from_tensor"]
        assert [u["ranks"][0] for u in ups] == [pytest.approx(_sums(b["1"])), pytest.approx(_sums(b["2"]))]
        assert dep.draft_version == "2"
    finally:
        dep.close()


def _swap_script():
    import importlib.util
    spec = importlib.util.spec_from_file_location("tidespec_sglang_swap", sg.SWAP_SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_swap_places_each_rank_where_the_server_runs_it():
    """The swap script's placement comes from the server's /server_info: TP rank r on local GPU
    base_gpu_id + r·gpu_id_step (SGLang 0.5.23 `entrypoints/engine.py::_launch_scheduler_processes`);
    a server without an EAGLE3 draft, with dp/pp/nnodes > 1 or on another device is refused, naming it."""
    swap = _swap_script()
    info = {"tp_size": 2, "base_gpu_id": 1, "gpu_id_step": 2, "device": "cuda", "dp_size": 1, "pp_size": 1,
            "nnodes": 1, "speculative_algorithm": "EAGLE3", "speculative_draft_model_path": "/d"}
    assert swap.rank_devices(info) == ["cuda:1", "cuda:3"]
    four = info | {"tp_size": 4, "base_gpu_id": 0, "gpu_id_step": 1}
    assert swap.rank_devices(four) == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert swap.rank_devices(info | {"device": "cpu"}) == ["cpu", "cpu"]
    for bad, msg in [({"speculative_algorithm": None}, "no EAGLE3 draft"),
                     ({"speculative_draft_model_path": None}, "no EAGLE3 draft"),
                     ({"dp_size": 2}, "dp_size 2"), ({"pp_size": 2}, "pp_size 2"), ({"nnodes": 2}, "nnodes 2"),
                     ({"device": "npu"}, "device 'npu'"),
                     # a malformed reply names its field (tp_size 0 once loaded nothing and answered success)
                     ({"tp_size": 0}, "tp_size is 0: expected an integer >= 1"), ({"tp_size": "2"}, "tp_size is '2'"),
                     ({"tp_size": True}, "tp_size is True"), ({"base_gpu_id": None}, "base_gpu_id is None"),
                     ({"gpu_id_step": 0}, "gpu_id_step is 0"), ({"dp_size": 0}, "dp_size is 0")]:
        with pytest.raises(swap.Refused, match=msg):
            swap.rank_devices(info | bad)
    with pytest.raises(swap.Refused, match="tp_size is None"):
        swap.rank_devices({k: v for k, v in info.items() if k != "tp_size"})


def test_swap_reads_the_server_and_refuses_before_any_change(fake_python, tiny_target, tmp_path, monkeypatch):
    """Against the recorded API: a draft whose tensors differ in shape from the served draft's files
    is refused before the pause (SGLang 0.5.23 would kill its scheduler on the loader error), and so is
    a server whose TP ranks run on GPUs this process cannot see (read from its /server_info:
    --base-gpu-id 1 --gpu-id-step 2, tp 2 → cuda:1, cuda:3); the served draft keeps serving."""
    from conftest import random_draft
    from tidespec.adapters.process import free_port
    from tidespec.backends.sglang.deployment import SGLangDeployment
    from tidespec.models.eagle3 import save_checkpoint
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("SGLANG_RECORD", str(record))
    b = _bundles(tiny_target, tmp_path)
    wide = save_checkpoint(random_draft(tiny_target, vd=128), tmp_path / "wide")  # lm_head [128, H]
    launch = sg.SGLangLaunch("/m/target", python=fake_python, port=free_port(), num_steps=3)
    dep = SGLangDeployment(launch, tmp_path / "a", ready_timeout_s=60).start(b["1"])
    try:
        n0 = len(_calls(record))
        with pytest.raises(sg.SGLangRefused, match="before any change.*lm_head.weight"):
            sg.load_draft_in_place(dep.url, wide, fake_python)
        assert [c["path"] for c in _calls(record, n0)] == ["/server_info"]
        res = dep.install(b["2"])
        assert res["mode"] == "in_place" and res["devices"] == ["cpu"] and dep.draft_version == "2"
    finally:
        dep.close()
    if torch.cuda.is_available() and torch.cuda.device_count() > 3:
        pytest.skip("cuda:3 is visible here: the placement refusal needs fewer GPUs")
    gpus = replace(launch, port=free_port(), tp_size=2,
                   extra_args=("--device", "cuda", "--base-gpu-id", "1", "--gpu-id-step", "2"))
    dep = SGLangDeployment(gpus, tmp_path / "b", ready_timeout_s=60).start(b["1"])
    try:
        n0 = len(_calls(record))
        for _ in range(2):
            with pytest.raises(sg.SGLangRefused, match=r"\['cuda:1', 'cuda:3'\].*CUDA_VISIBLE_DEVICES"):
                dep.install(b["2"])
        assert [c["path"] for c in _calls(record, n0)] == ["/server_info"] * 2 and dep.draft_version == "1"
        assert [d.name for d in (tmp_path / "b/drafts").iterdir()] == ["1-v1"]  # no copy left of a refused draft
    finally:
        dep.close()


def test_serve_backend_sglang_starts_it_and_loads_each_champion_in_place(fake_python, tiny_target_dir, tmp_path):
    """The path a user takes: `tidespec serve --backend sglang --sglang-python PY` starts SGLang (its
    launch line from the params: the champion as EAGLE3 draft, engine.num_draft_tokens steps, context
    length, max running requests, served name) behind the front door; a champion the cycle deploys
    into data/drafts/champion is loaded into that same server in place; stopping the command stops it."""
    import signal
    import subprocess

    from conftest import health, tiny_params_yaml, wait_until
    from tidespec.adapters.process import free_port
    from tidespec.models.target import load_target
    from tidespec.workspace import Workspace
    target = load_target(tiny_target_dir)[0]
    b = _bundles(target, tmp_path)
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "params.yaml").write_text(tiny_params_yaml(tiny_target_dir)
                                      + "serve: {watch_champion_s: 0.3, served_model_name: tiny}\n")
    champion = Workspace(proj).champion
    champion.parent.mkdir(parents=True)
    shutil.copytree(b["1"], champion)
    record, port = tmp_path / "calls.jsonl", free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL")}
    proc = subprocess.Popen([sys.executable, "-m", "tidespec.cli", "serve", "--backend", "sglang", "--sglang-python",
                             fake_python, "--root", str(proj), "--params", str(proj / "params.yaml"), "--port",
                             str(port), "--no-capture", "--no-publish"], cwd=proj,
                            env=env | {"SGLANG_RECORD": str(record)}, stdout=open(tmp_path / "serve.log", "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        h = wait_until(lambda: health(url), 120, "/health", proc)
        assert h["engine"] == "sglang" and h["draft_version"] == "1", h
        argv = _calls(record)[0]["argv"]
        flags = {a: argv[i + 1] for i, a in enumerate(argv[:-1]) if a.startswith("--")}
        assert flags["--speculative-num-steps"] == "3" and flags["--speculative-eagle-topk"] == "1"
        assert flags["--speculative-num-draft-tokens"] == "4" and flags["--context-length"] == "256"
        assert flags["--max-running-requests"] == "8" and flags["--served-model-name"] == "tiny"
        assert flags["--model-path"] == str(tiny_target_dir)
        assert flags["--speculative-draft-model-path"].endswith("1-v1")
        assert flags["--dtype"] == "float32" and flags["--attention-backend"] == "triton"  # target.dtype, honoured
        import httpx
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 12}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == " recorded"
        staged = champion.parent / ".staged"
        shutil.copytree(b["2"], staged)
        shutil.rmtree(champion)
        staged.rename(champion)
        wait_until(lambda: (h := health(url)) and h["draft_version"] == "2", 60, "v2 served", proc)
        ups = [c for c in _calls(record) if c.get("path") == "/update_weights_from_tensor"]
        assert len(ups) == 1 and ups[0]["selector"] == "draft"
        assert ups[0]["ranks"] == [pytest.approx(_sums(b["2"]))]
        assert len([c for c in _calls(record) if "argv" in c]) == 1  # the same server: none started beside it
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{flags['--port']}/health", timeout=2)  # SGLang stopped with it
    out = (tmp_path / "serve.log").read_text()  # the swap is logged with the version now served
    assert "INFO tidespec.backends.sglang.deployment: SGLang now serves draft 2, loaded in place" in out, out[-2000:]


def _under_load(app, swap):
    """`swap()` run while 3 clients send completions through the front door `app`: (its result, every
    request's status)."""
    import asyncio
    import threading
    import time

    import httpx
    statuses, done = [], threading.Event()

    async def load():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://fd", timeout=60) as c:
            async def one():
                r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 12})
                statuses.append(r.status_code)
            while not done.is_set():
                await asyncio.gather(*(one() for _ in range(3)))
            await asyncio.gather(*(one() for _ in range(3)))
    t = threading.Thread(target=lambda: asyncio.run(load()))
    t.start()
    try:
        time.sleep(0.5)
        return swap(), statuses
    finally:
        done.set()
        t.join(60)


def test_sglang_counters_and_their_standard_error():
    """SGLang's counters (the exposition prometheus_client writes for its Counters) → drafts = verify
    calls, accepted = output tokens − requests (each one's prefill token) − verify calls, summed over
    label sets; requests that never verified (max_tokens 1) change nothing; no verify counter → None
    (unknown, never 0). Without per-position counts the SE is the Bhatia–Davis bound
    sqrt(μ(k−μ)/n): at μ = 1.5, k = 3, n = 1000 it is sqrt(2.25/1000) = 0.04743."""
    def text(generated, requests):
        return textwrap.dedent(f"""\
            # TYPE sglang:spec_verify_calls_total counter
            sglang:spec_verify_calls_total{{model_name="m"}} 600.0
            sglang:spec_verify_calls_total{{model_name="n"}} 400.0
            # TYPE sglang:generation_tokens_total counter
            sglang:generation_tokens_total{{is_streaming="false",model_name="m"}} 1600.0
            sglang:generation_tokens_total{{is_streaming="true",model_name="m"}} {generated - 1600}.0
            # TYPE sglang:num_requests_total counter
            sglang:num_requests_total{{is_streaming="false",model_name="m"}} 120.0
            sglang:num_requests_total{{is_streaming="true",model_name="m"}} {requests - 120}.0
            """)
    c = sg.parse_metrics(text(2700, 200), 3)
    assert (c.num_drafts, c.num_accepted_tokens, c.num_draft_tokens, c.accepted_per_pos) == (1000, 1500, 3000, ())
    assert c.acceptance_length == 2.5 and c.acceptance_length_se == pytest.approx(0.0474342, rel=1e-5)
    assert sg.parse_metrics(text(2760, 260), 3) == c  # 60 one-token requests: no drafts, nothing accepted
    assert sg.parse_metrics("# TYPE sglang:generation_tokens counter\nsglang:generation_tokens_total 5.0\n", 3) is None
    from tidespec.engine.spec_counters import live_below_replay
    assert live_below_replay(c, 2.65) and not live_below_replay(c, 2.64)  # 2.5 + 3 × 0.0474 = 2.642


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
FP32 = sg.SGLANG_FLOAT32_ARGS  # fp32 runs (to compare with our fp32 target): fa3 takes fp16/bf16 only


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
    from tidespec.models.hf_files import target_dir
    from tidespec.workspace import engine_dir
    target, tok = real_target
    hf = Path(target_dir("smollm2"))  # the GGUF dequantised once into an HF dir
    champion = ROOT / "data/drafts/champion"  # a bundle: SGLang loads its draft/ (config.json + weights)
    draft = engine_dir(champion) if champion.exists() else save_checkpoint(random_draft(target, vd=4096),
                                                                            tmp_path / "draft")
    common = dict(python=SGLANG_PY, dtype="float32", extra_args=FP32)
    # three servers on one GPU: each sizes its pools from the memory free when it starts
    cfgs = {"serve": sg.SGLangLaunch(str(hf), port=free_port(), draft_path=str(draft), num_steps=4,
                                     mem_fraction_static=0.3, **common),
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


@pytest.mark.gpu
@pytest.mark.skipif(sg.unavailable_reason(SGLANG_PY) is not None, reason="needs CUDA + an SGLang 0.5.23 env "
                                                                         "($TIDESPEC_SGLANG_PYTHON)")
def test_real_sglang_swaps_the_draft_in_place(tmp_path, real_target):
    """SmolLM2 + two drafts of one config on a real SGLang: v2 loaded in place into the server serving v1
    (the same process) gives the outputs and spec-decode counters, on fixed prompts, of a fresh server
    started with v2; the outputs are the target's alone either way."""
    import httpx

    from conftest import random_draft
    from tidespec.adapters.process import free_port
    from tidespec.backends.sglang.deployment import SGLangDeployment
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.models.hf_files import target_dir
    from tidespec.workspace import make_bundle, write_version
    target, tok = real_target
    hf = str(target_dir("smollm2"))
    b = {}
    for v in ("1", "2"):
        b[v] = make_bundle(save_checkpoint(random_draft(target, vd=4096, seed=int(v)), tmp_path / f"d{v}"),
                           tmp_path / f"b{v}")
        write_version(b[v], v, "run")
    prompts = [tok(t)["input_ids"] for t in ("def fibonacci(n):", "import json\n\ndef load(path):",
                                              "Write a haiku about the sea.")]

    def fixed(dep):
        before, outs = dep.scrape(), []
        for ids in prompts:
            r = httpx.post(f"{dep.url}/generate", json={"input_ids": ids, "sampling_params": {
                "max_new_tokens": 48, "temperature": 0.0}}, timeout=300)
            outs.append(r.json()["output_ids"])
        return outs, dep.scrape() - before

    launch = sg.SGLangLaunch(hf, python=SGLANG_PY, port=free_port(), dtype="float32", num_steps=4,
                             mem_fraction_static=0.3, extra_args=FP32)
    dep = SGLangDeployment(launch, tmp_path / "a").start(b["1"])
    try:
        pid = dep.server.proc.pid
        v1_out, v1_counts = fixed(dep)
        res = dep.install(b["2"])
        assert res["mode"] == "in_place" and dep.server.proc.pid == pid and dep.draft_version == "2"
        httpx.post(f"{dep.url}/flush_cache", timeout=60)
        swapped_out, swapped_counts = fixed(dep)
    finally:
        dep.close()
    fresh = SGLangDeployment(replace(launch, port=free_port()), tmp_path / "b").start(b["2"])
    try:
        fresh_out, fresh_counts = fixed(fresh)
    finally:
        fresh.close()
    assert v1_out == swapped_out == fresh_out
    assert swapped_counts == fresh_counts and swapped_counts != v1_counts, (swapped_counts, v1_counts)
