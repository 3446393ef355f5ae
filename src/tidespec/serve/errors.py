"""OpenAI's error envelope `{"error": {"message", "type", "param", "code"}}` and the exception
handlers that answer every error in it, for `tidespec serve` and the front door alike (the `openai`
SDK then raises its typed exceptions with our message).

Two kinds of failure, told apart by type, never by `ValueError`:
- a client error (`OpenAIError`, status 4xx): a refused or invalid field is 400 with `param` naming
  it; request-body validation (`RequestValidationError`) is mapped the same way;
- a server failure (status 500): `EngineError` when the engine failed a request (its Future
  resolved to an exception, `ValueError` included), `InternalError` for anything else a handler
  raised. The message and the body
  (`error.request_id`) carry the request id; the traceback goes to the server log under that id and
  never into the response.
A streamed response sends the same body as one `data:` event (`OpenAIError.sse`), so a client sees
the same error whether it streamed or not.
"""
from __future__ import annotations

import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)


class OpenAIError(Exception):
    """An error answered in OpenAI's envelope. status: HTTP status; param: the offending request
    field (None when not one field); code: a short machine code; type: OpenAI's error type (default:
    by status, `TYPES`); headers: extra response headers (e.g. Retry-After); request_id: the request
    the error belongs to (server errors), also in the body."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error", 500: "server_error",
             504: "timeout_error"}

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 headers: dict[str, str] | None = None, *, type: str | None = None, request_id: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.headers = message, param, status, code, headers
        self.type, self.request_id = type, request_id

    def body(self) -> dict:
        """The envelope: {"error": {"message", "type", "param", "code"[, "request_id"]}}."""
        return error_body(self.message, self.status, self.param, self.code, type=self.type,
                          request_id=self.request_id)

    def response(self) -> JSONResponse:
        """The error as a whole HTTP response (its status, headers and envelope)."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as one server-sent event (a stream's status is already 200 when it fails)."""
        return f"data: {json.dumps(self.body())}\n\n"


def error_body(message: str, status: int, param: str | None = None, code: str | None = None, *,
               type: str | None = None, request_id: str | None = None) -> dict:
    """OpenAI's error envelope for an HTTP `status`; `request_id` is added only when given."""
    err = {"message": message, "type": type or OpenAIError.TYPES.get(status, "server_error"), "param": param,
           "code": code}
    if request_id is not None:
        err["request_id"] = request_id
    return {"error": err}


class RequestTimeout(OpenAIError):
    """504: a request still running after `timeout_s` s (it has been aborted)."""

    def __init__(self, timeout_s: float):
        super().__init__(f"request took longer than {timeout_s:g} s (serve.request_timeout_s)", status=504,
                         code="timeout")


class EngineError(OpenAIError):
    """500: the engine failed request `request_id` (its Future resolved to an exception). Build it
    with `of`, which logs the cause with its traceback under the request id; the client gets the id
    only."""

    def __init__(self, request_id: str):
        super().__init__(f"the engine failed on request {request_id}; the server log has the details under this "
                         "request id", status=500, code="engine_error", request_id=request_id)

    @classmethod
    def of(cls, request_id: str, cause: BaseException, engine_request_id: str | None = None) -> EngineError:
        """The error for `cause`, logged (engine_request_id: the failed choice's own engine request)."""
        log.error("request %s failed in the engine (engine request %s)", request_id,
                  engine_request_id or request_id, exc_info=cause)
        return cls(request_id)


class InternalError(OpenAIError):
    """500: a handler raised something that is no `OpenAIError` (a server bug, not the client's
    fault). Build it with `of`, which logs the cause with its traceback under the request id; the
    client gets the id only."""

    def __init__(self, request_id: str):
        super().__init__(f"internal server error on request {request_id}; the server log has the details under "
                         "this request id", status=500, code="internal_error", request_id=request_id)

    @classmethod
    def of(cls, cause: BaseException, request_id: str | None = None, where: str = "") -> InternalError:
        """The error for `cause`, logged under `request_id` (a new one when None)."""
        request_id = request_id or uuid.uuid4().hex
        log.error("request %s failed%s", request_id, f" ({where})" if where else "", exc_info=cause)
        return cls(request_id)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of `app` in OpenAI's envelope: `OpenAIError` as it says; a request-body
    validation error as 400 naming the field; an HTTP error (unknown route, wrong method) with its
    status; any other exception as `InternalError` (500 with a request id; Starlette then re-raises it
    so the server logs it too)."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, e: OpenAIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        return validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        return OpenAIError(str(e.detail), status=e.status_code, headers=getattr(e, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return InternalError.of(e, where=f"{request.method} {request.url.path}").response()


def validation_error(e: RequestValidationError) -> OpenAIError:
    """The first error of a request body's validation as a 400 naming the field (`param`, dotted;
    list indices dropped): unknown fields say so, others carry pydantic's message."""
    err = e.errors()[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not isinstance(x, int)]
    param = ".".join(loc) or None
    if err.get("type") == "extra_forbidden":
        msg = (f"unknown parameter {param!r}: this server does not support it "
               "(docs/api.md lists every parameter it takes)")
    else:
        msg = f"{param}: {err.get('msg')}" if param else str(err.get("msg"))
    return OpenAIError(msg, param, 400, err.get("type"))
