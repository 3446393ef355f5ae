"""Hidden states from a vLLM server (its `extract_hidden_states` speculative method and tidespec's CPU connector): the
prefill that rebuilds a text exchange's capture record, as a rehydrator for `capture.ingest`."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

from .server import VLLMError, VLLMLaunch, VLLMServer


def rehydration_layers(aux_layers, num_layers: int) -> tuple[int, ...]:
    """The vLLM layer ids a rehydration extracts: the target's aux layers (tidespec/SpecForge ids are
    output-of-layer i = vLLM's input of layer i + 1) and the last layer's output (id = num_layers,
    before the final norm; `VLLMRehydrator` applies it)."""
    return tuple(int(i) + 1 for i in aux_layers) + (int(num_layers),)


def read_hidden_states(path: str, timeout_s: float = 60.0) -> dict:
    """The file vLLM's hidden-states connector wrote for one request (`hidden_states` `[T, n, H]`,
    `token_ids` `[T]`), once its writer released the file's lock (a shared flock on `<path>.lock`,
    as vLLM's `load_hidden_states`); both files are removed after reading. Raises VLLMError when
    the file does not appear within `timeout_s` s."""
    import fcntl
    import time

    from safetensors.torch import load_file
    lock, deadline = Path(path + ".lock"), time.monotonic() + timeout_s
    while not lock.exists() and not Path(path).exists():
        if time.monotonic() > deadline:
            raise VLLMError(f"vLLM wrote no hidden states at {path} within {timeout_s:g} s")
        time.sleep(0.01)
    if lock.exists():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)  # sleeps until the writer thread closes its exclusive lock
    data = load_file(path, device="cpu")
    for p in (Path(path), lock):
        p.unlink(missing_ok=True)
    return data


class VLLMRehydrator:
    """`capture.ingest.Rehydrator` backed by a vLLM server started with `extract_layers =
    rehydration_layers(target.aux_layers, L)` (`VLLMLaunch`): each exchange is one `/v1/completions`
    with the prompt + generation ids as the prompt and max_tokens 1 (vLLM's prefill, batched with the
    others in flight: `batch_size` concurrent requests); its hidden states come back through the
    connector's file. Record: aux `[T, 3H]` = the three aux layers concatenated in order, hidden
    `[T, H]` = the target's final RMSNorm over the last layer's output, in the target's dtype; equal
    to the embedded prefill within fp32 noise (tests/test_vllm_real.py). An exchange the embedded
    check refuses (`capture.rehydrate.check_exchange`) or vLLM rejects (400) comes back as its
    ValueError; a server error raises VLLMError."""

    def __init__(self, url: str, target, model: str | None = None, batch_size: int = 16, timeout_s: float = 600.0):
        self.url, self.target, self.model = url.rstrip("/"), target, model
        self.batch_size, self.timeout_s = batch_size, timeout_s

    def __call__(self, exchanges: list[tuple[list[int], list[int]]]) -> list:
        from concurrent.futures import ThreadPoolExecutor

        import httpx
        with httpx.Client(timeout=self.timeout_s) as client, ThreadPoolExecutor(self.batch_size) as ex:
            return list(ex.map(lambda e: self._one(client, *e), exchanges))

    def _one(self, client, prompt: list[int], gen: list[int]):
        import torch

        from ...capture.rehydrate import check_exchange, make_record
        from ...models.layers import rms_norm
        try:
            ids = check_exchange(self.target, prompt, gen)
        except ValueError as e:
            return e
        body = {"prompt": ids, "max_tokens": 1, "temperature": 0} | ({"model": self.model} if self.model else {})
        r = client.post(f"{self.url}/v1/completions", json=body)
        if r.status_code == 400:
            return ValueError(f"vLLM refused the exchange: {r.text[:300]}")
        if r.status_code != 200:
            raise VLLMError(f"vLLM at {self.url} answered {r.status_code}: {r.text[:300]}")
        path = (r.json().get("kv_transfer_params") or {}).get("hidden_states_path")
        if not path:
            raise VLLMError(f"vLLM at {self.url} returned no hidden_states_path: is it started with extract_layers?")
        data = read_hidden_states(path)
        hs, got = data["hidden_states"], data["token_ids"].tolist()
        if got != ids or hs.shape[1] != 4:
            raise VLLMError(f"vLLM's hidden states are for {len(got)} tokens × {hs.shape[1]} layers, expected "
                            f"{len(ids)} × 4 (3 aux + last)")
        dt, c = self.target.dtype, self.target.cfg
        aux = hs[:, :3].reshape(len(ids), -1).to(dt)
        hidden = rms_norm(hs[:, 3].to(torch.float32), self.target.norm.float().cpu(), c.rms_norm_eps).to(dt)
        return make_record(ids, len(prompt), aux, hidden)


@contextmanager
def rehydrator_for(params, target, state_dir: Path, python: str | None = None, step: str = "ingest"):
    """The rehydrator `ingest.rehydrate_backend` names, for one ingest run or (`step="train"`) one
    train step over tokens-only records (context manager): None for `embedded` (the target in this
    process) and for an ingest under `ingest.mode: online` (it rehydrates nothing), a
    `VLLMRehydrator` on `ingest.rehydrate_url`, or on a vLLM server
    started here (`python`, else `default_python()`) with the target's
    HF dir, hidden-state extraction into `state_dir`/vllm-extract, stopped on exit. Raises
    VLLMUnavailable / VLLMError as `VLLMServer.start`."""
    ing = params.ingest
    if ing.rehydrate_backend == "embedded" or (step == "ingest" and ing.mode == "online"):
        yield None
        return
    if ing.rehydrate_url:
        yield VLLMRehydrator(ing.rehydrate_url, target, batch_size=ing.rehydrate_batch)
        return
    out = Path(state_dir) / "vllm-extract"
    out.mkdir(parents=True, exist_ok=True)
    cfg = VLLMLaunch.from_params(params, python=python, extract_dir=str(out),
                                 extract_layers=rehydration_layers(target.aux_layers, target.cfg.num_layers),
                                 max_model_len=target.cfg.max_position, max_num_seqs=ing.rehydrate_batch)
    with VLLMServer(cfg, Path(state_dir) / "vllm-extract.log") as srv:
        yield VLLMRehydrator(srv.url, target, batch_size=ing.rehydrate_batch)
