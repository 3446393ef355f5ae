"""Load a tidespec EAGLE3 draft into a running SGLang server's draft, in place. Run by SGLang's own
interpreter, on the server's node, with the server's CUDA_VISIBLE_DEVICES (never imported by tidespec):

    <sglang python> tidespec_sglang_swap.py --url URL --draft DIR [--timeout-s S]

SGLang 0.5.23 sources cited below are under `python/sglang/srt/`.
0. GET /server_info (`entrypoints/http_server.py`: `ServerArgs.resolved_dict()`): the server's own
   `tp_size`, `base_gpu_id`, `gpu_id_step`, `device`, `dp_size`, `pp_size`, `nnodes`,
   `speculative_algorithm`, `speculative_draft_model_path`. TP rank r runs on local GPU
   `base_gpu_id + r * gpu_id_step` (`entrypoints/engine.py::_launch_scheduler_processes`, one node,
   pp 1), so rank r's tensors go there (each rank copies its own payload, index tp_rank, to its own
   GPU: `managers/tp_worker.py::deserialize_own_rank`, `model_runner_components/weight_updater.py::
   _unwrap_tensor`). Refused (exit 2, nothing changed) without an EAGLE3 draft (the draft selector
   then updates nothing and answers success), with dp_size > 1 (`tokenizer_control_mixin.py`
   asserts dp_size == 1), pp_size > 1 or nnodes > 1 (CUDA IPC stays on one node), or when the new
   draft's tensors differ in names or shapes from the served draft's files: SGLang's tensor update
   does not catch a loader error, so one bad shape kills its scheduler, and the whole server.
Then the draft-only weight update (`managers/scheduler_components/weight_updater.py`,
`_select_runners("draft")`), inside a pause of the scheduler:
1. POST /pause_generation {"mode": "retract"}: running requests go back to the waiting queue with
   their state (their KV is recomputed after step 5); new ones wait. While paused, the weight calls
   skip the tokenizer manager's writer lock, which would otherwise wait for every request in flight
   to finish, and block new ones, once per call (`tokenizer_control_mixin._weight_update_session_call`);
2. POST /begin_weight_update {"selector": "draft"};
3. POST /update_weights_from_tensor {"serialized_named_tensors": [one per TP rank], "selector":
   "draft", "flush_cache": true}: the draft's tensors on each rank's GPU, serialized by SGLang's
   `MultiprocessingSerializer` (CUDA IPC: only handles travel; base64 strings over HTTP), held here
   until the call returns; the flush (allowed while paused: `Scheduler.flush_cache` ignores the
   waiting queue then) drops every cached prefix the old draft computed;
4. POST /end_weight_update (also after a failed step 3, so no session stays open);
5. POST /continue_generation (always, once step 1 succeeded).
`d2t`/`t2d` are not sent: SGLang's EAGLE worker copies the vocabulary map once at start, so
tidespec refuses an in-place swap that changes it. `/update_weights_from_disk` is not the route:
it loads the one path into the target's runners as well. Each call waits at most `--timeout-s`.

Prints one JSON line: {"seconds", "tensors", "flushed", "devices" (one per TP rank)}; exits 2 with
the reason on stderr when it stopped before step 1 (nothing changed), 1 when a call failed.
"""
import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

SKIP = ("d2t", "t2d")


class Refused(Exception):
    """The server or the draft does not allow an in-place load; nothing was changed."""


def post(url: str, path: str, body: dict | None, timeout_s: float) -> tuple[int, str]:
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def call(url: str, path: str, body: dict | None, timeout_s: float) -> None:
    code, text = post(url, path, body, timeout_s)
    try:
        ok = code == 200 and json.loads(text).get("success", True)
    except ValueError:
        ok = False
    if not ok:
        raise RuntimeError(f"SGLang {path} answered {code}: {text[:300]}")


def server_info(url: str, timeout_s: float) -> dict:
    """GET /server_info as a dict. Raises Refused when the server does not answer it."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/server_info", timeout=timeout_s) as r:
            info = json.loads(r.read().decode())
    except (OSError, ValueError) as e:
        raise Refused(f"SGLang at {url} did not answer /server_info ({type(e).__name__}: {e})") from None
    if not isinstance(info, dict):
        raise Refused(f"SGLang at {url} answered /server_info with a {type(info).__name__}, not its server args")
    return info


def setting(info: dict, key: str, default: int | None = None, least: int = 0) -> int:
    """The integer `key` of /server_info (`default` when absent). Raises Refused naming the field
    when it is missing, not an integer, or below `least`."""
    v = info.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise Refused(f"/server_info field {key} is {v!r}: expected an integer >= {least} (a malformed reply)")
    return v


def rank_devices(info: dict) -> list[str]:
    """The device of each TP rank ("cuda:G", G = base_gpu_id + rank * gpu_id_step; "cpu" on a CPU
    server) from /server_info. Raises Refused naming the setting an in-place load cannot serve."""
    algo = str(info.get("speculative_algorithm") or "").upper()
    if algo != "EAGLE3" or not info.get("speculative_draft_model_path"):
        raise Refused(f"the server runs no EAGLE3 draft (speculative_algorithm {info.get('speculative_algorithm')!r})"
                      ": restart it with one")
    for key in ("dp_size", "pp_size", "nnodes"):
        if setting(info, key, 1, least=1) != 1:
            raise Refused(f"{key} {info[key]}: the in-place draft load serves dp_size, pp_size and nnodes 1 only "
                          "(SGLang asserts dp_size 1; CUDA IPC stays on one node); restart the server to change drafts")
    tp, base, step, device = (setting(info, "tp_size", least=1), setting(info, "base_gpu_id", 0),
                              setting(info, "gpu_id_step", 1, least=1), str(info.get("device") or "cuda"))
    if device == "cpu":
        return ["cpu"] * tp
    if device != "cuda":
        raise Refused(f"device {device!r}: the in-place draft load places tensors on CUDA GPUs only")
    return [f"cuda:{base + r * step}" for r in range(tp)]


def shapes(files) -> dict[str, tuple]:
    """{name: shape} of every tensor in safetensors `files` (headers only), less d2t/t2d."""
    from safetensors import safe_open
    out = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            out |= {k: tuple(h.get_slice(k).get_shape()) for k in h.keys() if k not in SKIP}
    return out


def check_like_served(draft: str, served: str) -> None:
    """Raise Refused unless the tensors sent (`draft`/model.safetensors) have the names and shapes
    of those SGLang loaded at start (every *.safetensors in `served`)."""
    old, new = shapes(sorted(Path(served).glob("*.safetensors"))), shapes([Path(draft) / "model.safetensors"])
    if not old:
        raise Refused(f"the served draft {served} has no *.safetensors on this node to check the new one against")
    diff = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if diff:
        raise Refused(f"the draft's tensors differ from the served draft's ({', '.join(diff[:5])}: "
                      f"{[(old.get(k), new.get(k)) for k in diff[:5]]}); SGLang sized its buffers for the served one")


def payloads(draft: str, devices: list[str]) -> tuple[list[str], int, list]:
    """One serialized [(name, tensor)] list per TP rank (tensors on that rank's device), the tensor
    count, and the tensors themselves (kept alive until SGLang has copied them). Raises Refused
    when a rank's GPU is not visible here."""
    import torch
    from safetensors.torch import load_file
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    gpus = [int(d.split(":")[1]) for d in devices if d.startswith("cuda")]
    if gpus and max(gpus) >= (torch.cuda.device_count() if torch.cuda.is_available() else 0):
        raise Refused(f"the server's TP ranks run on {devices}, not all visible here: run this with the server's "
                      "CUDA_VISIBLE_DEVICES")
    monkey_patch_torch_reductions()
    weights = {k: v for k, v in load_file(f"{draft}/model.safetensors").items() if k not in SKIP}
    out, held = [], []
    for dev in devices:
        named = [(k, v.to(dev)) for k, v in weights.items()]
        held.append(named)
        out.append(MultiprocessingSerializer.serialize(named, output_str=True))
    return out, len(weights), held


def swap(a, serialized: list[str]) -> None:
    """Steps 1-5 of the module docstring. Raises RuntimeError with SGLang's answer."""
    call(a.url, "/pause_generation", {"mode": "retract"}, a.timeout_s)
    try:
        call(a.url, "/begin_weight_update", {"selector": "draft"}, a.timeout_s)
        try:
            call(a.url, "/update_weights_from_tensor", {"serialized_named_tensors": serialized,
                                                        "selector": "draft", "flush_cache": True}, a.timeout_s)
        finally:
            call(a.url, "/end_weight_update", {}, a.timeout_s)
    finally:
        call(a.url, "/continue_generation", {}, a.timeout_s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--draft", required=True, help="a draft engine dir (model.safetensors + config.json)")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per call")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        info = server_info(a.url, a.timeout_s)
        devices = rank_devices(info)
        check_like_served(a.draft, str(info["speculative_draft_model_path"]))
        serialized, n, held = payloads(a.draft, devices)
    except Exception as e:  # noqa: BLE001 - before the pause: nothing changed on the server
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 2
    try:
        swap(a, serialized)
        del held
    except Exception as e:  # noqa: BLE001 - reported to the caller, which keeps the served draft
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"seconds": time.perf_counter() - t0, "tensors": n, "flushed": True, "devices": devices}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
