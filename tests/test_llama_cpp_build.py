"""`make llama-server` (`backends.llama_cpp.build`): the pinned source archive, fetched and verified
like the asset wheels, and the portable, static build keyed by the llama.cpp commit, found where
`make` put it. Fast: nothing is downloaded or compiled (the real build serves
tests/test_llama_cpp_real.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tidespec import assets
from tidespec.backends.llama_cpp import build


def test_the_sdist_is_pinned_and_downloaded_as_a_source_archive():
    w = build.SDIST
    assert w.spec == "llama-cpp-python==0.3.36" and len(w.sha256) == 64 and w.sdist
    cmd = assets.pip_download_cmd(w, Path("/d"))
    assert cmd[:7] == [sys.executable, "-m", "pip", "download", "--no-deps", "-d", "/d"]
    assert cmd[-2:] == ["--no-binary", ":all:"] and "--only-binary" not in cmd
    assert w not in assets.WHEELS.values()  # `tidespec fetch` does not pull 77 MB of C++ for everyone


def test_fetch_pinned_reuses_a_verified_file_and_refuses_a_changed_one(tmp_path, monkeypatch):
    d = assets.wheels_dir(tmp_path)
    d.mkdir(parents=True)
    (d / "x-1.tar.gz").write_bytes(b"sources")
    good = assets.Wheel("x", "1", "x-1.tar.gz", assets.sha256_file(d / "x-1.tar.gz"), sdist=True)
    assert assets.fetch_pinned(good, tmp_path) == d / "x-1.tar.gz"
    monkeypatch.setattr(assets, "_pip_download", lambda w, dest: (dest / w.filename).write_bytes(b"changed"))
    bad = assets.Wheel("x", "1", "x-1.tar.gz", "0" * 64, sdist=True)
    with pytest.raises(assets.AssetError, match="sha256 mismatch for x-1.tar.gz"):
        assets.fetch_pinned(bad, tmp_path)


def test_the_build_is_portable_static_and_keyed_by_the_llama_cpp_commit(tmp_path, monkeypatch):
    monkeypatch.delenv(build.ENV_HOME, raising=False)
    home = build.server_home(tmp_path)
    assert home == tmp_path / "llama-server" / build.LLAMA_CPP_COMMIT[:12]
    monkeypatch.delenv(assets.ENV_CACHE, raising=False)
    monkeypatch.chdir(tmp_path)  # no build under ./.cache: the checkout's, as `make llama-server` put it there
    monkeypatch.setattr(build, "CHECKOUT", tmp_path / "repo")
    (tmp_path / "repo" / ".cache" / "tidespec" / "llama-server" / home.name).mkdir(parents=True)
    assert build.server_home() == tmp_path / "repo" / ".cache" / "tidespec" / "llama-server" / home.name
    here = tmp_path / ".cache" / "tidespec" / "llama-server" / home.name
    here.mkdir(parents=True)
    assert build.server_home() == here  # ./.cache first
    cmd = build.cmake_configure(Path("/src"), Path("/b"))
    for flag in ("-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release"):
        assert flag in cmd
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    assert "-G" not in build.cmake_configure(Path("/src"), Path("/b"))  # no ninja: cmake's default generator
    monkeypatch.setenv(build.ENV_HOME, str(tmp_path / "dev"))
    assert build.server_home() == tmp_path / "dev"


def test_an_unbuilt_server_names_make_llama_server(tmp_path):
    why = build.missing(tmp_path)
    assert "make llama-server" in why and "llama-server" in why
    env = build.converter_env(tmp_path)
    assert env["PYTHONPATH"].split(":")[:2] == [str(tmp_path / "gguf-py"), str(tmp_path / "pydeps")]
