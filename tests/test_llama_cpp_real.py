"""A real llama.cpp `llama-server` (`make llama-server`) running a tidespec draft converted to an
EAGLE-3 GGUF (`backends.llama_cpp`).

Target: SmolLM2-135M-Instruct Q4_1 as shipped (the asset GGUF); draft: trained here with the repo's
trainer on the target's own greedy outputs of the served prompts, so acceptance is well above 0 and
the counters discriminate a right conversion from a wrong one. Skipped, with the reason printed,
only where llama-server is not built (`backends.llama_cpp.unavailable_reason`).
"""
from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from tidespec.backends import llama_cpp
from tidespec.backends.llama_cpp.convert import draft_gguf

K, MAX_TOKENS = 4, 32
PROMPTS = ["def fibonacci(n):\n", "The three primary colours are", "import json\n\ndef load(path):\n",
           "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def built() -> None:
    reason = llama_cpp.unavailable_reason()
    if reason:
        pytest.skip(f"llama.cpp cannot run here: {reason}")


@pytest.fixture(scope="module")
def trained(built, real_target, tmp_path_factory) -> tuple[Path, Path]:
    """(the draft trained on the target's greedy outputs of PROMPTS, the cache its GGUFs go to)."""
    from tidespec.config import DraftParams, EngineParams, TrainParams
    from tidespec.engine.speculative import Engine, Request
    from tidespec.train.trainer import train_draft
    target, tok = real_target
    ids = [tok.encode(p, add_special_tokens=False) for p in PROMPTS]
    gens = Engine(target, None, EngineParams(num_draft_tokens=K, max_seq_len=256, max_batch=4)).generate_batch(
        [Request(p, MAX_TOKENS + 16, speculative=False, capture=True) for p in ids])
    out = tmp_path_factory.mktemp("llama-draft") / "draft"
    train_draft([g.record for g in gens], [], target, DraftParams(draft_vocab_size=1024),
                TrainParams(epochs=30, ttt_steps=K, batch_tokens=1024, max_seq_len=128, lr=3e-3), out)
    (out / "train_metrics.json").unlink()
    return out, tmp_path_factory.mktemp("llama-cache")


def _serve(draft: Path | None, tmp: Path, name: str) -> tuple[list[str], llama_cpp.SpecDecodeCounters | None]:
    """Each PROMPT completed greedily by a llama-server with `draft` (None: plain decoding); the
    texts and the server's counters after them."""
    # one thread: on a shared 2-core machine a second, spinning one slowed decoding several times over
    cfg = llama_cpp.LlamaCppLaunch.from_params(_params(), draft_path=str(draft) if draft else None, parallel=2,
                                               ctx_per_slot=512, threads=1)
    with llama_cpp.LlamaCppServer(cfg, tmp / f"{name}.log") as srv:
        texts = []
        for p in PROMPTS:
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": p, "max_tokens": MAX_TOKENS,
                                                               "temperature": 0, "ignore_eos": True}, timeout=300)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        return texts, llama_cpp.scrape(srv.url)


def _params():
    from tidespec.config import Params
    return Params()


def test_eagle3_draft_is_lossless_and_a_wrong_conversion_collapses_acceptance(trained, tmp_path):
    from tidespec.models.hf_files import target_dir
    draft, cache = trained
    hf = target_dir("smollm2")
    gguf = draft_gguf(draft, hf, cache=cache)
    assert draft_gguf(draft, hf, cache=cache) == gguf  # converted once per content
    plain, none = _serve(None, tmp_path, "plain")
    spec, counters = _serve(gguf, tmp_path, "eagle3")
    assert spec == plain  # greedy: the target's own tokens, drafted or not
    assert none is not None and none.num_drafts == 0
    tau = counters.acceptance_length
    assert counters.num_drafts > 0 and len(counters.accepted_per_pos) == K
    assert tau > 1.5, counters
    assert counters.per_position_rate[0] >= counters.per_position_rate[-1]

    swapped = tmp_path / "swapped"  # the three aux layers in another order: converts fine, drafts badly
    shutil.copytree(draft, swapped)
    cfg = json.loads((swapped / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_aux_hidden_state_layer_ids"][::-1]
    (swapped / "config.json").write_text(json.dumps(cfg))
    bad, worse = _serve(draft_gguf(swapped, hf, cache=cache), tmp_path, "swapped")
    assert bad == plain
    assert worse.acceptance_length - 1 < 0.5 * (tau - 1), (worse, counters)


def test_tidespec_serve_backend_llama_cpp_as_a_user_and_a_champion_swapped_blue_green(trained, tmp_path):
    """`tidespec serve --backend llama-cpp` in its own process: the champion served as llama.cpp's EAGLE-3
    draft behind the front door (text capture, `store: false` kept out of it, `n > 1` refused), llama.cpp's
    counters on the front door's /metrics, and the next champion the cycle deploys swapped in blue/green
    while requests keep coming, none failing."""
    import os
    import threading

    import yaml

    from conftest import health, serving, wait_until
    from tidespec.assets import cache_dir
    from tidespec.workspace import write_version
    draft, cache = trained
    proj = tmp_path / "proj"
    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    raw["engine"] |= {"max_batch": 2, "max_seq_len": 512}
    raw["serve"] |= {"watch_champion_s": 0.5, "served_model_name": "smol"}
    proj.mkdir()
    (proj / "params.yaml").write_text(yaml.safe_dump(raw))
    champion = proj / "data" / "drafts" / "champion"
    shutil.copytree(draft, champion / "draft")
    write_version(champion, "1", "run-1")
    env = {k: v for k, v in os.environ.items()  # no registry, no Prefect, none of llama-server's own settings
           if k not in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL") and not k.startswith("LLAMA_")}
    env |= {"TIDESPEC_CACHE": str(cache_dir()), "OMP_NUM_THREADS": "1"}  # the project's downloads, from --root
    with serving(proj, tmp_path, env, "--backend", "llama-cpp") as (url, proc):
        h = wait_until(lambda: health(url), 300, "/health", proc)
        assert h["engine"] == "llama-cpp" and h["draft_version"] == "1"
        for i, p in enumerate(PROMPTS[:3]):
            r = httpx.post(f"{url}/v1/completions", json={"model": "smol", "prompt": p, "max_tokens": 16,
                                                          "temperature": 0, "store": i != 1}, timeout=300)
            assert r.status_code == 200, r.text
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "n": 2}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        assert "tidespec:frontdoor_requests_total" in metrics
        counters = llama_cpp.parse_metrics(metrics)
        assert counters.num_drafts > 0 and counters.acceptance_length > 1.2, counters

        statuses, stop = [], threading.Event()

        def traffic():
            while not stop.is_set():
                statuses.append(httpx.post(f"{url}/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 8,
                                                                         "temperature": 0, "store": False},
                                           timeout=300).status_code)
        t = threading.Thread(target=traffic)
        t.start()
        new = tmp_path / "champion-2"  # deploy.local's way: a whole directory renamed into place
        shutil.copytree(draft, new / "draft")
        cfg = json.loads((new / "draft" / "config.json").read_text())
        cfg["tidespec"]["warm_start"] = "v1"  # another draft's content: converted anew during the swap
        (new / "draft" / "config.json").write_text(json.dumps(cfg))
        write_version(new, "2", "run-2")
        os.rename(champion, tmp_path / "champion-1")
        os.rename(new, champion)
        wait_until(lambda: (health(url) or {}).get("draft_version") == "2", 300, "the new champion served", proc)
        time.sleep(2)
        stop.set()
        t.join(300)
        assert statuses and set(statuses) == {200}, statuses
        assert health(url)["backend"] != h["backend"]  # blue/green: another llama-server
    out = (tmp_path / "serve.log").read_text()
    swap = [line for line in out.splitlines() if "llama.cpp now serves draft 2" in line]
    assert swap, out
    print(swap[0])
    captured = "".join(f.read_text() for f in (proj / "data" / "capture").rglob("*") if f.is_file())
    assert "def fibonacci" in captured and "import json" in captured and "primary colours" not in captured
