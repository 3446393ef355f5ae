"""The API key of `tidespec serve`'s OpenAI routes (`--api-key`, `$TIDESPEC_API_KEY`), as vLLM's
`--api-key`: a guarded request must carry `Authorization: Bearer <key>`, else 401 in OpenAI's
envelope with `WWW-Authenticate: Bearer`. One ASGI middleware (`api_key_middleware`) for the
embedded server and the front door alike.

Guarded: every route but `/admin/*` (its own bearer token, `serve.admin`, kept separate) and, unless
`serve.auth_health_metrics`, `/health` and `/metrics` (load balancers and Prometheus scrape them).
Unlike vLLM, which guards the `/v1` prefix only, a route is guarded unless it is named open, so a
route added later cannot be left open by mistake. The key is compared in constant time (SHA-256
digests, `secrets.compare_digest`: neither its content nor its length leaks through timing).
`OPTIONS` passes (a CORS preflight carries no credentials), as in vLLM.
"""
from __future__ import annotations

import hashlib
import secrets

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import OpenAIError

OPERATIONAL = ("/health", "/metrics")  # open unless serve.auth_health_metrics
ADMIN_PREFIX = "/admin/"  # the admin token's routes (`serve.admin.authorize`)


def api_key_middleware(key: str | None, auth_health_metrics: bool = False) -> list[Middleware]:
    """The middleware list of an app whose routes take `key` (None: no key, every route open: []).
    `auth_health_metrics`: guard /health and /metrics too. Raises ValueError for an empty key, or
    for `auth_health_metrics` without a key (nothing to guard them with)."""
    if key is None:
        if auth_health_metrics:
            raise ValueError("auth_health_metrics guards /health and /metrics with the API key: pass the key")
        return []
    if not key:
        raise ValueError("the API key is empty: pass the key clients send as a bearer token, or None")
    return [Middleware(ApiKeyAuth, key=key, open_paths=() if auth_health_metrics else OPERATIONAL)]


class ApiKeyAuth:
    """Pure ASGI middleware (streams pass through untouched): an HTTP request to a guarded path
    without `Authorization: Bearer <key>` (scheme case-insensitive) is answered 401 before any
    route runs. `open_paths`: exact paths that need no key (besides `/admin/*` and `OPTIONS`)."""

    def __init__(self, app: ASGIApp, key: str, open_paths: tuple[str, ...] = OPERATIONAL):
        self.app, self.open_paths = app, open_paths
        self._digest = _digest(key)

    def guards(self, path: str) -> bool:
        """Whether `path` needs the key."""
        return path not in self.open_paths and not path.startswith(ADMIN_PREFIX)

    def authorized(self, headers: Headers) -> bool:
        """Whether `headers` carry the key as a bearer token (constant-time comparison)."""
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(_digest(token.strip()), self._digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        headers = Headers(scope=scope)
        if self.guards(path) and not self.authorized(headers):
            given = bool(headers.get("authorization"))
            message = ("incorrect API key provided" if given else
                       "missing API key: send it as `Authorization: Bearer <key>`")
            await OpenAIError(message, status=401, code="invalid_api_key",
                              headers={"WWW-Authenticate": "Bearer"}).response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()
