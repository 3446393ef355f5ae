"""FastAPI lifespan (the replacement of the deprecated `@app.on_event("shutdown")`) shared by
`tidespec serve` and the front door: what to close at shutdown, in order."""
from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

log = logging.getLogger(__name__)

Closer = Callable[[], object | Awaitable[object]]


def closing(*closers: Closer | None) -> Callable[[FastAPI], AsyncIterator[None]]:
    """A lifespan for `FastAPI(lifespan=...)` that, at shutdown, calls each of `closers` in order
    (sync or async; None entries are skipped). One that raises is logged and the rest still run, so
    a failing watcher cannot keep the capture from being flushed."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        for close in closers:
            if close is None:
                continue
            try:
                out = close()
                if inspect.isawaitable(out):
                    await out
            except Exception:  # close the rest
                log.exception("shutdown step %r failed", close)
    return lifespan
