"""Load test of `tidespec serve`: N concurrent clients on 127.0.0.1 for a bounded time, a draft
hot-swap half-way, greedy outputs checked against target-only output.

`serve_in_thread` runs the app under uvicorn in this process (a daemon thread); `load` drives it
with httpx (async, one connection per client). Reports status counts, tokens/s, request latency
p50/p99 (ms), the server process's RSS (MiB, sampled), outputs that differ from the reference,
and which draft versions served.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

import numpy as np
import psutil

from ..adapters.process import free_port


@dataclass
class ServerThread:
    url: str
    server: object
    thread: threading.Thread

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)


def serve_in_thread(app, port: int | None = None, timeout_s: float = 30.0) -> ServerThread:
    """Start `app` with uvicorn on 127.0.0.1 (free port if None) in a daemon thread; returns once
    /health answers. Raises TimeoutError after `timeout_s` s."""
    import httpx
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, name="tidespec-uvicorn", daemon=True)
    t.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return ServerThread(url, server, t)
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.should_exit = True
    raise TimeoutError(f"server on {url} not healthy in {timeout_s:g} s")


async def _load(url: str, prompts: list[list[int]], reference: dict[int, list[int]] | None, clients: int,
                duration_s: float, max_tokens: int, swap: dict | None, admin_token: str | None) -> dict:
    import httpx
    proc = psutil.Process()
    res = {"status": {}, "latency_ms": [], "tokens": 0, "mismatches": 0, "versions": {}, "errors": [], "rss_mib": []}
    t0 = time.monotonic()
    stop_at = t0 + duration_s

    async def client(i: int, http: httpx.AsyncClient):
        j = i
        while time.monotonic() < stop_at:
            p = j % len(prompts)
            j += clients
            t = time.perf_counter()
            try:
                r = await http.post(f"{url}/v1/completions", json={"prompt": prompts[p], "max_tokens": max_tokens,
                                                                   "temperature": 0})
            except httpx.HTTPError as e:
                res["status"]["transport_error"] = res["status"].get("transport_error", 0) + 1
                res["errors"].append(repr(e))
                continue
            res["status"][r.status_code] = res["status"].get(r.status_code, 0) + 1
            if r.status_code != 200:
                res["errors"].append(r.text[:200])
                continue
            res["latency_ms"].append(1000 * (time.perf_counter() - t))
            ext = r.json()["tidespec"]
            res["tokens"] += len(ext["token_ids"])
            res["versions"][str(ext["draft_version"])] = res["versions"].get(str(ext["draft_version"]), 0) + 1
            if reference is not None and ext["token_ids"] != reference[p]:
                res["mismatches"] += 1

    async def sampler():
        while time.monotonic() < stop_at:
            res["rss_mib"].append(proc.memory_info().rss / 2**20)
            await asyncio.sleep(0.5)

    async def swapper(http: httpx.AsyncClient):
        await asyncio.sleep(duration_s / 2)
        r = await http.post(f"{url}/admin/draft", json=swap, headers={"Authorization": f"Bearer {admin_token}"})
        res["swap"] = {"status": r.status_code, "at_s": round(time.monotonic() - t0, 2), "body": r.json()}

    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        tasks = [client(i, http) for i in range(clients)] + [sampler()] + ([swapper(http)] if swap else [])
        await asyncio.gather(*tasks)
    res["wall_s"] = time.monotonic() - t0
    return res


def load(url: str, prompts: list[list[int]], reference: dict[int, list[int]] | None = None, clients: int = 64,
         duration_s: float = 60.0, max_tokens: int = 32, swap: dict | None = None,
         admin_token: str | None = None) -> dict:
    """Drive the server at `url` with `clients` concurrent greedy clients for `duration_s` s (each
    client finishes its request in flight), swapping the draft (`swap`: the /admin/draft body) at
    half time. `reference[i]`: the target-only output of prompts[i] (mismatches counted).
    Returns {status: {code: n}, requests, tokens, tokens_per_s, latency_ms_p50/p99, rss_mib_max,
    rss_mib_start, mismatches, versions: {draft version: responses}, swap, errors (first 5)}."""
    r = asyncio.run(_load(url, prompts, reference, clients, duration_s, max_tokens, swap, admin_token))
    lat = np.array(r["latency_ms"]) if r["latency_ms"] else np.zeros(1)
    return {"status": r["status"], "requests": len(r["latency_ms"]), "tokens": r["tokens"],
            "tokens_per_s": r["tokens"] / r["wall_s"], "wall_s": r["wall_s"],
            "latency_ms_p50": float(np.percentile(lat, 50)), "latency_ms_p99": float(np.percentile(lat, 99)),
            "rss_mib_start": r["rss_mib"][0] if r["rss_mib"] else None,
            "rss_mib_max": max(r["rss_mib"]) if r["rss_mib"] else None,
            "mismatches": r["mismatches"], "versions": r["versions"], "swap": r.get("swap"), "errors": r["errors"][:5]}
