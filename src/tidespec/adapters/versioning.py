"""DVC versioning of snapshots, through the venv's ``dvc`` CLI (run with ``cwd=repo``).

The "snapshot rev" of a tracked path is the ``outs[0].md5`` of its ``.dvc`` file: a content
hash (``<md5>.dir`` for a directory), so the same content always gives the same rev.
Every failing command raises VersioningError with the command, its stderr tail and a fix hint.
Analytics and update checks are off (env + repo config): nothing phones home.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from ..errors import TidespecError
from ..workspace import private_dir

TIMEOUT_S = 600.0
_ENV = {"DVC_NO_ANALYTICS": "1", "DVC_NO_UPDATER": "1", "GIT_TERMINAL_PROMPT": "0"}
_HINTS = (  # (substring of stderr, fix)
    ("not a git repository", "run versioning.ensure_repo(repo, remote_url) first"),
    ("not inside of a DVC repository", "run versioning.ensure_repo(repo, remote_url) first"),
    ("no remote specified", "configure a default remote: versioning.ensure_repo(repo, remote_url)"),
    ("missing cache files", "the remote lacks these objects: `dvc push` from the machine that tracked them"),
    ("does not exist", "check the path is relative to the repo and exists"),
    ("please tell me who you are", "set git user.email/user.name (ensure_repo does it locally)"),
)


class VersioningError(TidespecError):
    """A git/dvc command failed; ``cmd``, ``stderr`` (tail) and ``hint`` say what and how to fix."""

    def __init__(self, cmd: list[str], stderr: str, hint: str):
        self.cmd, self.stderr, self.hint = cmd, stderr, hint
        super().__init__(f"`{' '.join(cmd)}` failed: {stderr}\nfix: {hint}")


def _dvc() -> str:
    exe = Path(sys.executable).parent / "dvc"
    return str(exe) if exe.exists() else (shutil.which("dvc") or "dvc")


def _hint(text: str) -> str:
    low = text.lower()
    for needle, fix in _HINTS:
        if needle.lower() in low:
            return fix
    return "run the command by hand in the repo (add -v for dvc) to see the full error"


def _run(repo: Path, cmd: list[str], timeout_s: float = TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``cmd`` in ``repo``; raise VersioningError on non-zero exit (if ``check``) or timeout (s)."""
    try:
        p = subprocess.run(cmd, cwd=repo, capture_output=True, text=True, timeout=timeout_s,
                           env=os.environ | _ENV, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise VersioningError(cmd, f"timed out after {timeout_s:g} s",
                              "check the remote is reachable; raise the timeout for large data") from e
    except FileNotFoundError as e:
        raise VersioningError(cmd, str(e), f"install {cmd[0]} (dvc comes with tidespec's venv)") from e
    if check and p.returncode != 0:
        tail = "\n".join((p.stderr or p.stdout).strip().splitlines()[-15:])
        raise VersioningError(cmd, tail, _hint(tail))
    return p


def dvc(repo: Path, *args: str, timeout_s: float = TIMEOUT_S) -> str:
    """Run ``dvc <args>`` in ``repo``; returns stdout. Raises VersioningError."""
    return _run(Path(repo), [_dvc(), *args], timeout_s).stdout


def git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run ``git <args>`` in ``repo``. Raises VersioningError if ``check`` and it fails."""
    return _run(Path(repo), ["git", *args], check=check)


def _git_toplevel(repo: Path) -> Path | None:
    p = git(repo, "rev-parse", "--show-toplevel", check=False)
    return Path(p.stdout.strip()).resolve() if p.returncode == 0 else None


def ensure_repo(repo: Path, remote_url: str, remote_name: str = "local", machine_local: bool = False,
                endpoint_url: str | None = None, sse: str | None = "AES256", cache_type: str | None = None) -> None:
    """Make ``repo`` a git + DVC repo whose default remote ``remote_name`` is ``remote_url``.

    Idempotent. ``git init`` if not in a git work tree (and sets a local user.email/name when
    none is configured, so commits work); ``dvc init`` (``--subdir`` inside a bigger git repo);
    analytics off, autostage on. ``machine_local``: the remote is a path on this machine, so it is
    written to the git-ignored ``.dvc/config.local`` and nothing is auto-staged (used by the demo in
    a user's checkout). An ``s3://`` remote gets ``endpointurl`` (a moto server, MinIO...) when
    given and server-side encryption ``sse`` (hidden states can be inverted to recover prompts);
    credentials come from the usual AWS env/profile. ``cache_type`` (e.g. ``"hardlink,copy"``:
    immutable snapshots then cost no second copy on disk). The cache dir is made 0700.
    Raises VersioningError.
    """
    repo = Path(repo).resolve()
    repo.mkdir(parents=True, exist_ok=True)
    top = _git_toplevel(repo)
    if top is None:
        git(repo, "init", "-q")
        top = repo
    for key, val in (("user.email", "tidespec@localhost"), ("user.name", "tidespec")):
        if git(repo, "config", key, check=False).returncode != 0:
            git(repo, "config", key, val)
    if not (repo / ".dvc").is_dir():
        dvc(repo, "init", "-q", *([] if top == repo else ["--subdir"]))
    # each dvc call costs ~1 s of startup: read once, write only what differs
    have = dict(line.split("=", 1) for line in dvc(repo, "config", "-l", "--project").splitlines() if "=" in line)
    want = {"core.analytics": "false", "core.autostage": "false" if machine_local else "true",
            "core.check_update": "false"}
    for key, val in want.items():
        if have.get(key) != val:
            dvc(repo, "config", key, val)
    scope = ["--local"] if machine_local else []
    if machine_local:
        have = dict(line.split("=", 1) for line in dvc(repo, "config", "-l", "--local").splitlines() if "=" in line)
    if have.get(f"remote.{remote_name}.url") != remote_url or have.get("core.remote") != remote_name:
        dvc(repo, "remote", "add", *scope, "-d", "-f", remote_name, remote_url)
    opts = {}
    if remote_url.startswith("s3://"):
        opts = {"endpointurl": endpoint_url, "sse": sse}
    for key, val in opts.items():
        if val and have.get(f"remote.{remote_name}.{key}") != val:
            dvc(repo, "remote", "modify", *scope, remote_name, key, val)
    if cache_type and have.get("cache.type") != cache_type:
        dvc(repo, "config", *scope, "cache.type", cache_type)
    private_dir(repo / ".dvc" / "cache")
    if "://" not in remote_url:  # a local remote holds the same hidden states
        private_dir(Path(remote_url) if Path(remote_url).is_absolute() else repo / remote_url)


def snapshot_rev(repo: Path, path: Path) -> str:
    """``outs[0].md5`` of ``<path>.dvc``. Raises VersioningError if it is missing/unreadable."""
    dvcfile = _dvcfile(Path(repo), Path(path))
    try:
        return str(yaml.safe_load(dvcfile.read_text())["outs"][0]["md5"])
    except (OSError, KeyError, IndexError, TypeError, yaml.YAMLError) as e:
        raise VersioningError(["read", str(dvcfile)], repr(e), f"run versioning.track(repo, {path})") from e


def _dvcfile(repo: Path, path: Path) -> Path:
    full = path if path.is_absolute() else repo / path
    return full.with_name(full.name + ".dvc")


def _rel(repo: Path, path: Path) -> str:
    path = Path(path)
    return str(path.resolve().relative_to(Path(repo).resolve())) if path.is_absolute() else str(path)


def track(repo: Path, path: Path) -> str:
    """``dvc add <path>`` (file or directory, relative to ``repo`` or absolute inside it);
    returns the snapshot rev (content md5, ``….dir`` for a directory). Raises VersioningError."""
    rel = _rel(repo, path)
    dvc(repo, "add", "-q", rel)
    return snapshot_rev(repo, Path(rel))


def _targets(repo: Path, targets) -> list[str]:
    return [_rel(repo, t) for t in (targets or [])]


def push(repo: Path, targets: list[Path] | None = None, remote: str | None = None) -> str:
    """``dvc push [targets]`` to the default (or ``remote``) remote; returns dvc's output."""
    return dvc(repo, "push", *(["-r", remote] if remote else []), *_targets(repo, targets))


def pull(repo: Path, targets: list[Path] | None = None, remote: str | None = None) -> str:
    """``dvc pull [targets]``: fetch into the cache and check out the workspace; returns output."""
    return dvc(repo, "pull", *(["-r", remote] if remote else []), *_targets(repo, targets))


def drop_local(repo: Path, path: Path, keep: list[Path] = ()) -> int:
    """Retention: delete the workspace copy of the DVC-tracked directory ``path`` and its objects
    in the local cache (kept on the remote; ``dvc pull <path>.dvc`` restores it). Objects also
    listed by a tracked dir in ``keep`` stay. Uses DVC 3's documented cache layout
    (``files/md5/<2>/<rest>``; a ``.dir`` object is a JSON list of ``{md5, relpath}``).
    Returns the bytes freed from the cache. Raises VersioningError if ``path`` is not tracked."""
    repo, path = Path(repo), Path(path)
    cache = repo / ".dvc" / "cache" / "files" / "md5"

    def obj(md5: str) -> Path:
        return cache / md5[:2] / md5[2:]

    def listing(p: Path) -> list[dict]:
        f = obj(snapshot_rev(repo, p))
        return json.loads(f.read_text()) if f.exists() else []

    rev = snapshot_rev(repo, path)
    keep_md5 = {e["md5"] for k in keep for e in listing(Path(k))}
    freed = 0
    for e in listing(path):
        f = obj(e["md5"])
        if e["md5"] not in keep_md5 and f.exists():
            freed += f.stat().st_size
            f.unlink()
    full = path if path.is_absolute() else repo / path
    shutil.rmtree(full, ignore_errors=True)
    obj(rev).unlink(missing_ok=True)
    return freed


# `make repro`'s flags: a snapshot that retention left on the remote only (its `.dvc` pointer, no
# local copy) is a data-source stage with missing data, which plain `dvc repro` refuses ("missing
# data 'source'"); the curate stage pulls the ones its window needs (`steps.cycle.pull_window`)
REPRO_ARGS = ("repro", "--allow-missing")


def repro(repo: Path, stage: str | None = None) -> str:
    """``dvc repro --allow-missing [stage]`` (dvc.yaml stages; `REPRO_ARGS`, what `make repro` runs);
    returns dvc's stdout. Raises VersioningError."""
    return dvc(repo, *REPRO_ARGS, *([stage] if stage else []))


def _is_dvc_meta(p: str) -> bool:
    name = Path(p).name
    return (p.endswith(".dvc") or name in (".gitignore", "dvc.lock", "dvc.yaml", ".dvcignore")
            or p.startswith(".dvc/") or "/.dvc/" in p)


def commit_git(repo: Path, message: str) -> str | None:
    """Commit DVC metadata changes (``*.dvc``, ``.gitignore``, ``dvc.yaml``/``dvc.lock``, ``.dvc/``)
    and nothing else. Returns the new commit sha, or None if nothing changed. Raises VersioningError."""
    repo = Path(repo)
    out = git(repo, "status", "--porcelain", "-z", "--untracked-files=all", ".").stdout
    entries = [e for e in out.split("\0") if e]
    # porcelain -z: "XY path"; renames are followed by an extra entry with the old path
    top = _git_toplevel(repo) or repo.resolve()
    prefix = repo.resolve().relative_to(top)
    paths = []
    for e in entries:
        p = e[3:] if len(e) > 3 and e[2] == " " else e
        rel = str(Path(p).relative_to(prefix)) if str(prefix) != "." else p
        if _is_dvc_meta(rel) and rel not in paths:
            paths.append(rel)
    if not paths:
        return None
    git(repo, "add", "-A", "--", *paths)
    if git(repo, "diff", "--cached", "--quiet", "--", *paths, check=False).returncode == 0:
        return None
    git(repo, "commit", "-q", "-m", message, "--", *paths)
    return git(repo, "rev-parse", "HEAD").stdout.strip()


class RemoteShards:
    """Snapshot shards read from the DVC remote into a bounded local cache while training
    (`train.shard_cache_mb`): a shard missing from the workspace (a training node that never
    pulled the snapshot, or one retention dropped) is fetched alone through DVC's Python API
    (`dvc.api.DVCFileSystem` over `repo`: the tracked directory's listing, then the one object,
    from whichever remote the repo names: local, S3, ...), kept under `cache_dir` as
    `<md5>-<shard name>`, and the least recently used ones deleted once they hold more than
    `max_bytes` (never the one just fetched: at most `max_bytes` plus one shard are held). Safe
    across the producer thread and the ranks of one node (a file lock around fetch and eviction;
    a reader holding an evicted shard keeps it until it closes it). `peak_bytes`: the most the
    cache held; `fetched`: shards downloaded."""

    def __init__(self, repo: Path, cache_dir: Path, max_bytes: int):
        self.repo, self.dir, self.max_bytes = Path(repo).resolve(), Path(cache_dir), int(max_bytes)
        self.peak_bytes = self.fetched = 0
        self._fs = None

    def _rel(self, path: Path) -> str:
        return str(Path(path).resolve().relative_to(self.repo))

    def _fs_(self):
        if self._fs is None:
            from dvc.api import DVCFileSystem
            self._fs = DVCFileSystem(str(self.repo))
        return self._fs

    def digest(self, path: Path) -> str | None:
        """The shard's md5 from the DVC listing of its tracked snapshot (None: not tracked)."""
        try:
            return self._fs_().info(self._rel(path)).get("md5")
        except (FileNotFoundError, ValueError):
            return None

    def locate(self, path: Path) -> Path:
        """`path` itself when the workspace holds it, else its copy in the cache (fetched if
        needed). Raises FileNotFoundError naming the fix when neither the workspace nor the
        snapshot's DVC listing and remote have it."""
        if Path(path).exists():
            return Path(path)
        md5 = self.digest(path)
        if md5 is None:
            raise FileNotFoundError(f"shard {path} is neither here nor in a DVC-tracked snapshot: `tidespec "
                                    "snapshots pull` it, or track and push the snapshot where it was captured")
        dst = self.dir / f"{md5}-{Path(path).name}"
        self.dir.mkdir(parents=True, exist_ok=True)
        from filelock import FileLock
        with FileLock(str(self.dir / ".lock")):
            if dst.exists():
                os.utime(dst)  # most recently used
                return dst
            tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
            try:
                self._fs_().get_file(self._rel(path), str(tmp))
            except Exception as e:
                tmp.unlink(missing_ok=True)
                raise FileNotFoundError(f"shard {path} (md5 {md5}) could not be fetched from the DVC remote "
                                        f"({type(e).__name__}: {e}); `dvc push` it from where it was captured") from e
            os.replace(tmp, dst)
            self.fetched += 1
            self._evict(keep=dst)
        return dst

    def _evict(self, keep: Path) -> None:
        files = sorted((f for f in self.dir.iterdir() if f.is_file() and not f.name.startswith(".")),
                       key=lambda f: f.stat().st_mtime_ns)
        held = sum(f.stat().st_size for f in files)
        self.peak_bytes = max(self.peak_bytes, held)
        for f in files:
            if held <= self.max_bytes:
                break
            if f != keep:
                held -= f.stat().st_size
                f.unlink(missing_ok=True)
