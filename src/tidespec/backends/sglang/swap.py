"""Draft swaps on a running SGLang server: in place, through `plugin/tidespec_sglang_swap.py`
run by SGLang's own interpreter (the draft-only weight update of SGLang 0.5.23; that script's
docstring gives the calls), and the checks that decide whether a new draft can go in place."""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from .server import SGLangError

SWAP_SCRIPT = Path(__file__).resolve().parent / "plugin" / "tidespec_sglang_swap.py"
VOCAB_MAP = ("d2t", "t2d")
REFUSED = 2  # the swap script's exit status when it stopped before pausing the server


class SGLangRefused(SGLangError):
    """The in-place load stopped before it changed anything on the server; the served draft serves."""


def load_draft_in_place(url: str, draft_dir: Path, python: str, timeout_s: float = 120.0) -> dict:
    """Load the draft in `draft_dir` (model.safetensors) into the SGLang server at `url`, in place;
    `timeout_s` per SGLang call (six of them). TP size and each rank's GPU are the server's own
    (its /server_info: `tp_size`, `base_gpu_id`, `gpu_id_step`), so `python` must run on the
    server's node with its CUDA_VISIBLE_DEVICES. Returns {"seconds" (wall, here), "load_seconds"
    (the script's), "tensors", "flushed" (the radix cache was flushed), "devices" (one per TP
    rank)}. Raises SGLangRefused when it stopped before any change (no EAGLE3 draft served,
    dp/pp/nnodes > 1, tensors unlike the served draft's: SGLang 0.5.23 would crash its scheduler on
    a shape mismatch), SGLangError with SGLang's answer when a call fails (the draft may then be partly updated:
    load the served one again; the weight-update session and the pause are closed first, so a later
    load can run)."""
    t0 = time.perf_counter()
    cmd = [python, str(SWAP_SCRIPT), "--url", url, "--draft", str(draft_dir), "--timeout-s", f"{timeout_s:g}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=7 * timeout_s + 120)
    except (OSError, subprocess.TimeoutExpired) as e:
        _close_session(url)
        raise SGLangError(f"the in-place draft load did not finish ({type(e).__name__}: {e})") from None
    tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
    if r.returncode == REFUSED:  # stopped before pausing the server: nothing to close
        raise SGLangRefused(f"the in-place load of {draft_dir} was refused before any change: {tail}")
    if r.returncode < 0:  # the script was killed: SGLang said nothing
        _close_session(url)
        raise SGLangError(f"the in-place draft load of {draft_dir} was killed by signal {-r.returncode}")
    if r.returncode != 0:
        _close_session(url)
        raise SGLangError(f"SGLang refused the in-place draft load from {draft_dir}: {tail}")
    try:
        res = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SGLangError(f"the in-place draft load answered without its JSON line: {r.stdout[-200:]!r}") from None
    return {"seconds": time.perf_counter() - t0, "load_seconds": float(res["seconds"]),
            "tensors": int(res["tensors"]), "flushed": bool(res["flushed"]), "devices": list(res["devices"])}


def _close_session(url: str) -> None:
    """After a load that failed or was killed: end any weight-update session it left open (SGLang
    refuses every later one otherwise) and resume generation; best effort (each refusal is fine)."""
    import httpx
    for path in ("/end_weight_update", "/continue_generation"):
        try:
            httpx.post(f"{url.rstrip('/')}{path}", json={}, timeout=60)
        except httpx.HTTPError:
            pass


def vocab_map_change(served: Path, new: Path) -> str | None:
    """Why `new`'s draft→target vocabulary map (d2t, t2d in model.safetensors) cannot replace the
    served one's in place, or None when they are equal (SGLang's EAGLE worker reads it once at start)."""
    from safetensors import safe_open

    def maps(d: Path) -> dict:
        with safe_open(str(Path(d) / "model.safetensors"), "pt") as f:
            return {k: f.get_tensor(k) for k in VOCAB_MAP if k in f.keys()}
    a, b = maps(served), maps(new)
    changed = [k for k in VOCAB_MAP if (k in a) != (k in b) or (k in a and (a[k].shape != b[k].shape
                                                                         or not bool((a[k] == b[k]).all())))]
    return (f"the draft's vocabulary map changed ({', '.join(changed)}): SGLang reads it once at start"
            if changed else None)
