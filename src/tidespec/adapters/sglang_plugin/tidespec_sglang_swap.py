"""Load a tidespec EAGLE3 draft into a running SGLang server's draft, in place. Run by SGLang's own
interpreter, on the server's node (never imported by tidespec):

    <sglang python> tidespec_sglang_swap.py --url URL --draft DIR [--tp-size N] [--base-gpu-id G]

SGLang 0.5.23's draft-only weight update (`srt/managers/scheduler_components/weight_updater.py`:
`_select_runners("draft")`), inside a pause of the scheduler:
1. POST /pause_generation {"mode": "retract"}: running requests go back to the waiting queue with
   their state (their KV is recomputed after step 5); new ones wait. While paused, the weight calls
   skip the tokenizer manager's writer lock, which would otherwise wait for every request in flight
   to finish, and block new ones, once per call (`tokenizer_control_mixin._weight_update_session_call`);
2. POST /begin_weight_update {"selector": "draft"};
3. POST /update_weights_from_tensor {"serialized_named_tensors": [one per TP rank], "selector":
   "draft", "flush_cache": true}: the draft's tensors on each rank's GPU, serialized by SGLang's
   `MultiprocessingSerializer` (CUDA IPC: only handles travel), held here until the call returns;
   the flush (allowed while paused: `Scheduler.flush_cache` ignores the waiting queue then) drops
   every cached prefix the old draft computed;
4. POST /end_weight_update (also after a failed step 3, so no session stays open);
5. POST /continue_generation (always, once step 1 succeeded).
`d2t`/`t2d` are not sent: SGLang's EAGLE worker copies the vocabulary map once at start, so
tidespec refuses an in-place swap that changes it. `/update_weights_from_disk` is not the route:
it loads the one path into the target's runners as well. Each call waits at most `--timeout-s`.

Prints one JSON line: {"seconds", "tensors", "flushed"}; exits 1 with the reason on stderr.
"""
import argparse
import json
import sys
import time
import urllib.error
import urllib.request

SKIP = ("d2t", "t2d")


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


def payloads(draft: str, tp_size: int, base_gpu_id: int) -> tuple[list[str], int, list]:
    """One serialized [(name, tensor)] list per TP rank (tensors on that rank's GPU), the tensor
    count, and the tensors themselves (kept alive until SGLang has copied them)."""
    import torch
    from safetensors.torch import load_file
    from sglang.srt.utils.common import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    monkey_patch_torch_reductions()
    weights = {k: v for k, v in load_file(f"{draft}/model.safetensors").items() if k not in SKIP}
    out, held = [], []
    for rank in range(tp_size):
        dev = torch.device("cuda", base_gpu_id + rank) if torch.cuda.is_available() else torch.device("cpu")
        named = [(k, v.to(dev)) for k, v in weights.items()]
        held.append(named)
        out.append(MultiprocessingSerializer.serialize(named, output_str=True))
    return out, len(weights), held


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--draft", required=True, help="a draft engine dir (model.safetensors + config.json)")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--base-gpu-id", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per call")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        serialized, n, held = payloads(a.draft, a.tp_size, a.base_gpu_id)
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
        del held
    except Exception as e:  # noqa: BLE001 - reported to the caller, which keeps the served draft
        print(f"{type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"seconds": time.perf_counter() - t0, "tensors": n, "flushed": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
