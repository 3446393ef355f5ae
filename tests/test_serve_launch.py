"""`tidespec serve`'s checks before anything starts (`serve_launch.ServeLaunch`, `cli.serve_preflight`):
the shipped params.yaml, which writes out every default, is accepted by every backend; a setting a
backend cannot honour is refused only when it differs from its default, naming the key; a default a
backend runs without is a note. Fast: no model, no server."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tidespec.config import Params, ServeParams, load_params
from tidespec.config.serve_launch import ServeLaunch

SHIPPED = Path(__file__).resolve().parents[1] / "params.yaml"
NO_MLFLOW: dict[str, str] = {}


def shipped(**sections) -> Params:
    """The shipped params.yaml with `sections` merged over it (section → {key: value})."""
    raw = yaml.safe_load(SHIPPED.read_text())
    for name, over in sections.items():
        raw[name] = (raw.get(name) or {}) | over
    return Params.model_validate(raw)


def shipped_file(tmp_path: Path, **sections) -> Path:
    """`shipped(**sections)` written to a params file under `tmp_path`; returns its path."""
    f = tmp_path / "params-shipped.yaml"
    f.write_text(yaml.safe_dump(shipped(**sections).model_dump(mode="json")))
    return f


def test_changed_means_differs_from_the_default_not_written_out():
    s = ServeParams.model_validate({"auto_rollback": True, "health_check_s": 30.0, "classify_workload": False})
    assert s.model_fields_set == {"auto_rollback", "health_check_s", "classify_workload"}  # written out
    assert s.changed("auto_rollback", "health_check_s", "classify_workload", "max_queue") == ["classify_workload"]
    assert ServeParams(workload_by_model={"m": "code"}).changed("workload_by_model") == ["workload_by_model"]


@pytest.mark.parametrize("launch", [dict(backend="embedded"), dict(backend="vllm"), dict(backend="sglang"),
                                    dict(backend="sglang", sglang_url="http://127.0.0.1:30000"),
                                    dict(backend="llama-cpp")],
                         ids=["embedded", "vllm", "sglang", "sglang-url", "llama-cpp"])
def test_the_shipped_params_are_accepted_by_every_backend(launch):
    p = load_params(SHIPPED)
    assert p.serve.model_fields_set >= {"auto_rollback", "health_check_s", "classify_workload"}  # it spells them out
    for capture in (True, False):
        ServeLaunch.build(**launch, capture=capture).check(p, NO_MLFLOW)
    ServeLaunch.build(**launch).check(shipped(capture={"mode": "text"}), NO_MLFLOW)  # what the vLLM demo runs


def test_auto_rollback_without_mlflow_is_a_note_not_a_refusal():
    p = load_params(SHIPPED)
    notes = ServeLaunch().check(p, NO_MLFLOW)
    assert any("serve.auto_rollback" in n and "MLFLOW_TRACKING_URI is unset" in n for n in notes), notes
    assert not [n for n in ServeLaunch().check(p, {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"})
                if "auto_rollback" in n]
    assert not ServeLaunch().check(shipped(serve={"auto_rollback": False}), NO_MLFLOW)


@pytest.mark.parametrize("key,value", [("health_check_s", 5.0), ("classify_workload", False),
                                       ("workload_by_model", {"m": "code"})])
@pytest.mark.parametrize("backend", ["vllm", "sglang", "llama-cpp"])
def test_an_embedded_only_setting_changed_is_refused_on_a_front_door(backend, key, value):
    url = "http://127.0.0.1:30000" if backend == "sglang" else None
    with pytest.raises(ValueError, match=f"serve.{key}: the embedded engine's.*--backend {backend} does not use"):
        ServeLaunch.build(backend=backend, sglang_url=url, capture=False).check(shipped(serve={key: value}),
                                                                                NO_MLFLOW)


def test_keys_of_a_server_tidespec_starts_are_refused_for_your_own_sglang():
    """auto_rollback, live_stats_s, watch_champion_s, served_model_name act on a server tidespec starts
    (vLLM; SGLang without --sglang-url) and are refused before a server at --sglang-url, naming the fix."""
    changed = dict(auto_rollback=False, live_stats_s=10.0, watch_champion_s=2.0, served_model_name="m")
    for key, value in changed.items():
        for launch in (dict(backend="vllm"), dict(backend="sglang")):
            ServeLaunch.build(**launch, capture=False).check(shipped(serve={key: value}), NO_MLFLOW)
        with pytest.raises(ValueError, match=f"serve.{key}: --backend sglang at --sglang-url .*drop --sglang-url"):
            ServeLaunch.build(backend="sglang", sglang_url="http://127.0.0.1:30000", capture=False).check(
                shipped(serve={key: value}), NO_MLFLOW)
    tree = shipped(engine={"tree": {"eagle_topk": 2, "num_draft_tokens": 6}})
    ServeLaunch.build(backend="sglang", capture=False).check(tree, NO_MLFLOW)  # SGLang verifies trees


def test_backend_specific_refusals_name_the_key_or_flag():
    notes = ServeLaunch().check(shipped(serve={"live_stats_s": 10.0}), NO_MLFLOW)  # the embedded replica's counters
    assert any("serve.live_stats_s: MLFLOW_TRACKING_URI is unset, so this replica's live counters are logged "
               "nowhere" in n for n in notes), notes
    assert not [n for n in ServeLaunch().check(shipped(serve={"live_stats_s": 10.0}), {"MLFLOW_TRACKING_URI": "u"})
                if "live_stats_s" in n]
    notes = ServeLaunch.build(backend="vllm").check(load_params(SHIPPED), NO_MLFLOW)  # capture.mode: its default
    assert any("captures request/response text (capture.mode: text)" in n for n in notes), notes
    with pytest.raises(ValueError, match="engine.tree.eagle_topk > 1 applies to the embedded engine"):
        ServeLaunch.build(backend="vllm", capture=False).check(shipped(engine={"tree": {"eagle_topk": 2}}), NO_MLFLOW)
    notes = ServeLaunch.build(backend="vllm", capture=False).check(load_params(SHIPPED), NO_MLFLOW)
    assert any("fixed k = engine.num_draft_tokens = 4" in n for n in notes), notes
    int4 = shipped(target={"dtype": "bfloat16", "quantization": "int4"})
    ServeLaunch().check(int4, NO_MLFLOW)  # the embedded engine's own kernels
    for backend in ("vllm", "sglang"):
        with pytest.raises(ValueError, match=f"target.quantization int4 is the embedded engine's CPU kernels; "
                                             f"--backend {backend} runs the target with its own"):
            ServeLaunch.build(backend=backend, capture=False).check(int4, NO_MLFLOW)


def test_llama_cpp_refuses_what_it_cannot_honour_naming_the_key():
    """--backend llama-cpp serves the shipped target GGUF with EAGLE-3 chains on the CPU: a tree, another
    target or precision, and llama-server's own environment settings are refused naming the key and
    the fix; the goodput policy and the suffix proposer, on by default, are noted (a default never
    fails a documented command), as are the fixed k and the n > 1 the front door refuses."""
    launch = ServeLaunch.build(backend="llama-cpp", capture=False)
    with pytest.raises(ValueError, match="--backend llama-cpp runs EAGLE3 chains: engine.tree.eagle_topk > 1"):
        launch.check(shipped(engine={"tree": {"eagle_topk": 2}}), NO_MLFLOW)
    for target, key in (({"quantization": "int4"}, "target.quantization int4"), ({"dtype": "bfloat16"},
                        "target.dtype bfloat16"), ({"device": "cuda"}, "target.device cuda")):
        with pytest.raises(ValueError, match=f"{key}: --backend llama-cpp runs the target GGUF as shipped"):
            launch.check(shipped(target=target), NO_MLFLOW)
    with pytest.raises(ValueError, match="target.source '/m': --backend llama-cpp serves the shipped target GGUF"):
        launch.check(shipped(target={"source": "/m"}), NO_MLFLOW)
    for env in ({"LLAMA_API_KEY": "k"}, {"LLAMA_ARG_SPEC_TYPE": "none"}):
        with pytest.raises(ValueError, match=f"{next(iter(env))} set: the llama-server tidespec starts would read it"):
            launch.check(load_params(SHIPPED), env)
    notes = launch.check(load_params(SHIPPED), NO_MLFLOW)
    for said in ("fixed k = engine.num_draft_tokens = 4 (engine.adaptive, the goodput policy",
                 "engine.suffix, the suffix proposer", "decodes engine.max_batch = 8 requests at once, each up to 4096",
                 "answers n > 1 with EAGLE-3 by failing: the front door refuses both with 400"):
        assert any(said in n for n in notes), (said, notes)


@pytest.mark.parametrize("flags,message", [
    (dict(backend="vllm", sglang_url="http://x:1"), "--sglang-url goes with --backend sglang"),
    (dict(backend="sglang", sglang_url="http://x:1", sglang_python="/p"),
     "--sglang-python goes with --backend sglang without --sglang-url"),
    (dict(backend="vllm", sglang_python="/p"), "--sglang-python goes with --backend sglang"),
    (dict(vllm_python="/usr/bin/python3"), "--vllm-python goes with --backend vllm"),
    (dict(backend="vllm", max_queue=4), "--max-queue applies to the embedded engine"),
    (dict(backend="nope"), "--backend: Input should be 'embedded', 'vllm', 'sglang' or 'llama-cpp'"),
    (dict(backend="llama-cpp", vllm_python="/p"), "--vllm-python goes with --backend vllm"),
    (dict(backend="llama-cpp", max_tokens=4), "--max-tokens applies to the embedded engine"),
    (dict(request_timeout_s=float("inf")), "--timeout-s: Input should be a finite number"),
])
def test_flags_of_another_backend_are_refused_in_one_line(flags, message):
    with pytest.raises(ValueError) as e:
        ServeLaunch.build(**flags)
    assert message in str(e.value) and "\n" not in str(e.value) and "errors.pydantic.dev" not in str(e.value)


def test_preflight_runs_the_command_checks_on_its_own_arguments(tmp_path, capsys):
    """`serve_preflight` (what `tidespec serve` runs first) with the shipped params, in a root that is
    a DVC repo: accepted, the auto_rollback note printed; in one that is not, publishing is refused
    with the fix, and --no-publish is accepted."""
    from tidespec.cli.serve import serve_preflight
    (tmp_path / ".dvc").mkdir()
    p, ws, launch, pub = serve_preflight(tmp_path, SHIPPED, env=NO_MLFLOW)
    assert launch.backend == "embedded" and pub is not None and ws.root == tmp_path.resolve()
    out = " ".join(capsys.readouterr().out.split())  # rich wraps long lines
    assert "serve.auto_rollback: MLFLOW_TRACKING_URI is unset" in out
    assert f"capture is on (hidden states of served requests, under {tmp_path.resolve() / 'data/capture'})" in out
    bare = tmp_path / "bare"
    bare.mkdir()
    with pytest.raises(Exception, match="is not a DVC repo.*--no-publish"):
        serve_preflight(bare, SHIPPED, env=NO_MLFLOW)
    assert serve_preflight(bare, SHIPPED, publish=False, env=NO_MLFLOW)[3] is None
    capsys.readouterr()
    serve_preflight(bare, SHIPPED, capture=False, env=NO_MLFLOW)
    assert "capture is on" not in capsys.readouterr().out


def test_the_registry_as_champion_source_needs_mlflow(tmp_path):
    """`serve.champion_source: registry` (a replica following the registry's champion) is refused
    without MLFLOW_TRACKING_URI, by every server tidespec starts and at `tidespec serve`'s preflight,
    naming the setting and both fixes; before your own SGLang (tidespec swaps nothing there) it is
    a key of a server tidespec starts. `directory`, the default, needs nothing."""
    from tidespec.cli.serve import serve_preflight
    registry = shipped(serve={"champion_source": "registry"})
    refusal = (r"serve.champion_source: registry follows the MLflow registry's champion and MLFLOW_TRACKING_URI is "
               r"unset: set it to the registry's URL .* or set serve.champion_source: directory")
    for launch in (dict(backend="embedded"), dict(backend="vllm"), dict(backend="sglang")):
        with pytest.raises(ValueError, match=refusal):
            ServeLaunch.build(**launch, capture=False).check(registry, NO_MLFLOW)
        ServeLaunch.build(**launch, capture=False).check(registry, {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"})
    with pytest.raises(ValueError, match="serve.champion_source: --backend sglang at --sglang-url"):
        ServeLaunch.build(backend="sglang", sglang_url="http://127.0.0.1:30000", capture=False).check(
            registry, {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"})
    with pytest.raises(ValueError, match=refusal):
        serve_preflight(tmp_path, shipped_file(tmp_path, serve={"champion_source": "registry"}), capture=False,
                        env=NO_MLFLOW)
    assert shipped().serve.champion_source == "directory"
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({"serve": {"champion_source": "mlflow"}}))
    with pytest.raises(ValueError, match="serve.champion_source: Input should be 'directory' or 'registry'"):
        load_params(typo)


def test_an_engine_server_that_cannot_run_here_is_refused_before_any_note(tmp_path, capsys):
    """`tidespec serve --backend sglang|vllm` with an environment that is not there: refused by the
    adapter's probe, naming the fix, before any note or "starting" line is printed."""
    from tidespec.backends.sglang import SGLangUnavailable
    from tidespec.backends.vllm import VLLMUnavailable
    from tidespec.cli.serve import serve_preflight
    (tmp_path / ".dvc").mkdir()
    missing = str(tmp_path / "no-env" / "bin" / "python")
    for flags, refused, fix in ((dict(backend="sglang", sglang_python=missing), SGLangUnavailable, "install sglang"),
                                (dict(backend="vllm", vllm_python=missing), VLLMUnavailable, "make vllm")):
        with pytest.raises(refused, match=f"no usable Python at '{missing}'.*{fix}"):
            serve_preflight(tmp_path, SHIPPED, env=NO_MLFLOW, **flags)
        assert capsys.readouterr().out == ""


def test_an_engines_probe_is_kept_only_once_it_passed(tmp_path, monkeypatch):
    """`process.probed` (behind both adapters' `unavailable_reason`): a usable interpreter is not probed
    again in the process; a refusal is, every time; a relative path is keyed by the file it names."""
    from tidespec.adapters import process
    calls = []

    def probe(python):
        calls.append(python)
        return None if Path(python).exists() else "missing"
    rel, a, b = str(Path("env", "bin", "python")), tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (b / rel).parent.mkdir(parents=True)
    (b / rel).write_text("")
    engine = f"engine-{tmp_path.name}"
    monkeypatch.chdir(a)
    assert process.probed(engine, rel, probe) == "missing"
    monkeypatch.chdir(b)
    assert process.probed(engine, rel, probe) is None  # the refusal was not kept
    assert process.probed(engine, rel, probe) is None  # kept: not probed again
    monkeypatch.chdir(a)
    assert process.probed(engine, rel, probe) == "missing"  # the same relative path, another file
    assert calls == [rel, rel, rel]


def test_a_front_doors_text_capture_is_ingested_whatever_capture_mode_says(tmp_path):
    """A front door captures text with the shipped capture.mode (hidden), so tide-capture's default
    sources must include the text capture directory whenever it exists, or the loop would not close."""
    from tidespec.adapters.s3_capture import default_sources
    from tidespec.workspace import Workspace
    ws, p, tid = Workspace(tmp_path), load_params(SHIPPED), "ab" * 32
    assert p.capture.mode == "hidden" and default_sources(p, tid, ws) == []
    ws.text_capture_dir(tid).mkdir(parents=True)
    assert default_sources(p, tid, ws) == [str(ws.text_capture_dir(tid))]


def test_flag_values_are_refused_naming_the_flag(tmp_path):
    """A flag's bad value names the flag the user typed, and a flag is validated with the params as
    params.yaml is (serve.max_tokens < engine.max_seq_len)."""
    from tidespec.cli.serve import serve_preflight
    for flags, message in ((dict(request_timeout_s=float("inf")), "--timeout-s: Input should be a finite number"),
                           (dict(backend="sglang", sglang_url="ftp://x"), "--sglang-url: Value error"),
                           (dict(backend="sglang", sglang_url="http://"), "--sglang-url: 'http://' names no host"),
                           (dict(backend="sglang", sglang_url="http://h:abc"),
                            "--sglang-url: 'http://h:abc': Port could not be cast to integer value as 'abc'"),
                           (dict(backend="sglang", sglang_url="http://h:99999"),
                            "--sglang-url: 'http://h:99999': Port out of range 0-65535"),
                           (dict(backend="vllm", vllm_python=""), "--vllm-python: String should have at least")):
        with pytest.raises(ValueError) as e:
            ServeLaunch.build(**flags)
        assert str(e.value).startswith(message.split(": Value error")[0]), e.value
    with pytest.raises(ValueError, match=r"^--max-tokens 2000: serve.max_tokens \(2000\) must be < engine.max_seq_len"):
        serve_preflight(tmp_path, shipped_file(tmp_path, engine={"max_seq_len": 1024}), publish=False,
                        max_tokens=2000, env=NO_MLFLOW)
    p = serve_preflight(tmp_path, SHIPPED, publish=False, max_tokens=50, timeout_s=9.0, env=NO_MLFLOW)[0]
    assert (p.serve.max_tokens, p.serve.request_timeout_s) == (50, 9.0)  # what `tidespec serve` then runs
    with pytest.raises(ValueError, match=r"engine.max_new_tokens \(2000\), serve.max_tokens' default, must be <"):
        shipped(engine={"max_new_tokens": 2000, "max_seq_len": 1024})


@pytest.mark.parametrize("backend,key,value", [
    ("vllm", "max_queue", 3), ("vllm", "max_tokens", 50), ("vllm", "default_temperature", 0.7),
    ("sglang", "max_queue", 3), ("sglang", "default_temperature", 0.7)])
def test_a_serve_setting_a_front_door_forwards_past_is_refused(backend, key, value):
    for url in ([None, "http://127.0.0.1:30000"] if backend == "sglang" else [None]):
        with pytest.raises(ValueError, match=f"serve.{key}: --backend {backend}( at --sglang-url .*)? does not use"):
            ServeLaunch.build(backend=backend, sglang_url=url).check(shipped(serve={key: value}), NO_MLFLOW)


def test_the_acceptance_filter_is_refused_where_capture_is_text():
    p = shipped(capture={"max_acceptance_rate": 0.5})
    ServeLaunch().check(p, NO_MLFLOW)  # hidden-state capture on the embedded engine: its filter
    for launch in (ServeLaunch.build(backend="vllm"), ServeLaunch.build(backend="sglang", sglang_url="http://h:1")):
        with pytest.raises(ValueError, match="capture.max_acceptance_rate filters hidden-state capture"):
            launch.check(p, NO_MLFLOW)
    with pytest.raises(ValueError, match="text capture has no acceptance"):
        ServeLaunch().check(shipped(capture={"max_acceptance_rate": 0.5, "mode": "text"}), NO_MLFLOW)
    ServeLaunch.build(backend="vllm", capture=False).check(p, NO_MLFLOW)  # nothing captured: nothing to filter


def test_a_sigterm_while_an_engine_server_starts_raises_so_it_is_stopped():
    """`tidespec serve --backend vllm|sglang` starts the server in its own process group; a SIGTERM's
    default action ended tidespec without its `finally`, leaving that server running with no parent.
    Inside `_sigterm_raises` it is SystemExit(143), which `ServerProcess.start` answers by stopping the
    group; the previous handler is back afterwards."""
    import os
    import signal

    from tidespec.cli.serve import _sigterm_raises

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as e, _sigterm_raises():
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next line
    assert e.value.code == 143 and signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_engine_servers_tidespec_starts_run_target_dtype(tmp_path, monkeypatch, dtype):
    """`tidespec serve --backend vllm / sglang` start their server at target.dtype (it was vLLM's
    float32 and SGLang's auto whatever the params said); SGLang at float32 gets its triton attention
    backend (fa3, Hopper's default, refuses fp32), and a note says so."""
    from tidespec.backends.sglang import deployment as dep_sglang
    from tidespec.backends.vllm import deployment as dep_vllm
    from tidespec.cli import serve as cli_serve
    from tidespec.workspace import Workspace
    got = {}

    class Deployment:  # the launch the command built; nothing starts
        def __init__(self, launch, state):
            got["launch"] = launch

        def start(self, champion):
            return self
    monkeypatch.setattr(dep_vllm, "VLLMDeployment", Deployment)
    monkeypatch.setattr(dep_sglang, "SGLangDeployment", Deployment)
    p, ws = shipped(target={"dtype": dtype}), Workspace(tmp_path)
    cli_serve._start_vllm(p, ws, "/bin/true", "127.0.0.1")
    assert got["launch"].dtype == dtype
    cli_serve._start_sglang(p, ws, "/bin/true", "127.0.0.1")
    assert got["launch"].dtype == dtype
    assert got["launch"].extra_args == (("--attention-backend", "triton") if dtype == "float32" else ())
    notes = ServeLaunch.build(backend="sglang").check(p, NO_MLFLOW)
    assert any("triton attention backend" in n for n in notes) == (dtype == "float32")


def test_serve_logs_tidespecs_records_at_the_level_asked(monkeypatch):
    """`log_to_stderr` (what `tidespec serve` calls first): INFO by default, once however often it
    is called, $TIDESPEC_LOG_LEVEL honoured, an unknown level refused naming the variable."""
    import logging

    from tidespec.cli.common import log_to_stderr
    log = logging.getLogger("tidespec")
    monkeypatch.setattr(log, "handlers", [])
    monkeypatch.delenv("TIDESPEC_LOG_LEVEL", raising=False)
    log_to_stderr()
    log_to_stderr()
    assert log.level == logging.INFO and len(log.handlers) == 1 and not log.propagate
    monkeypatch.setenv("TIDESPEC_LOG_LEVEL", "warning")
    log_to_stderr()
    assert log.level == logging.WARNING
    monkeypatch.setenv("TIDESPEC_LOG_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="TIDESPEC_LOG_LEVEL='LOUD'"):
        log_to_stderr()
    log.setLevel(logging.NOTSET)
    log.propagate = True


def test_a_replica_is_named_by_its_id_else_by_host_and_port(monkeypatch):
    import socket
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu-node 7.cluster.local")
    assert ServeParams().replica(8001) == "gpu-node-7-8001"  # the host's first label, made a valid id
    assert ServeParams(replica_id="eu-1.a_b").replica(8001) == "eu-1.a_b"
    for bad in ("", "-lead", "a/b", "x" * 64, "tab\tid"):
        with pytest.raises(ValueError, match="replica_id"):
            ServeParams(replica_id=bad)


def test_a_canary_replica_follows_the_registry_and_logs_its_counters(tmp_path):
    """serve.canary needs serve.champion_source: registry and serve.live_stats_s > 0, refused naming the
    key and the fix; deploy.canary_windows and canary_max_wait_s go with deploy.rollout: canary; a
    canary at --sglang-url is refused as the other keys of a server tidespec starts."""
    with pytest.raises(ValueError, match="serve.canary: true .* set serve.champion_source: registry"):
        ServeParams(canary=True)
    with pytest.raises(ValueError, match="serve.live_stats_s is 0 .* set it > 0"):
        ServeParams(canary=True, champion_source="registry", live_stats_s=0)
    with pytest.raises(ValueError, match="serve.canary: true .* set serve.champion_source: registry"):
        load_params(shipped_file(tmp_path, serve={"canary": True}))
    canary = shipped(serve={"canary": True, "champion_source": "registry"})
    assert canary.serve.canary and not Params().serve.canary and Params().deploy.rollout == "direct"
    with pytest.raises(ValueError, match="serve.canary: --backend sglang at --sglang-url"):
        ServeLaunch.build(backend="sglang", sglang_url="http://127.0.0.1:30000", capture=False).check(
            shipped(serve={"canary": True, "champion_source": "registry"}), {"MLFLOW_TRACKING_URI": "u"})
    assert shipped(deploy={"rollout": "canary", "canary_windows": 5}).deploy.canary_windows == 5
    for knob, v in (("canary_windows", 5), ("canary_max_wait_s", 60)):
        with pytest.raises(ValueError, match=f"deploy.{knob} belongs to a canary rollout: set deploy.rollout: canary"):
            shipped(deploy={knob: v})
    assert shipped(deploy={"rollout": "canary", "canary_max_wait_s": 60}).deploy.canary_max_wait_s == 60
    with pytest.raises(ValueError, match="rollout"):
        shipped(deploy={"rollout": "blue-green"})
