"""OpenAI's error envelope `{"error": {"message", "type", "param", "code"}}` and the exception
handlers that answer every error of `tidespec serve` in it (the `openai` SDK then raises its typed
exceptions with our message)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class OpenAIError(Exception):
    """An error answered in OpenAI's envelope. status: HTTP status; param: the offending request
    field (None when not one field); type: OpenAI's error type; code: a short machine code."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
             404: "not_found_error", 409: "conflict_error", 429: "rate_limit_error", 504: "timeout_error"}

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.headers = message, param, status, code, headers

    def body(self) -> dict:
        """The envelope: {"error": {"message", "type", "param", "code"}}."""
        return error_body(self.message, self.status, self.param, self.code)

    def response(self) -> JSONResponse:
        """The error as a whole HTTP response (its status, headers and envelope)."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, status: int, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error envelope for an HTTP `status`."""
    return {"error": {"message": message, "type": OpenAIError.TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of `app` in OpenAI's envelope: `OpenAIError` as it says; a request-body
    validation error as 400 naming the field; an HTTP error with its status; a ValueError as 400."""

    @app.exception_handler(OpenAIError)
    async def _openai(_: Request, e: OpenAIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError):
        return validation_error(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(str(e.detail), e.status_code), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(ValueError)
    async def _bad(_: Request, e: ValueError):
        return JSONResponse(error_body(str(e), 400), status_code=400)


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
