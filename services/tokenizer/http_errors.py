"""The HTTP API's error contract: OpenAI error bodies, status codes, the body limit.

Every error leaves as ``{"error": {"message", "type", "param", "code"}}``
(RELIABILITY.md): 400 ``invalid_request_error`` for anything the client got wrong
(FastAPI's 422 validation answer and its invalid-JSON answer are overridden), 404 for
an unknown model or path, 413 for a body over ``http_max_body_bytes``, 431 for headers
over 100 fields or 32 KiB, 503 with
``Retry-After`` when the scheduler is overloaded or this frontend shuts down, 500
``engine_error`` when the engine failed a request. Nothing else may produce a 500:
an unexpected exception is logged and answered as ``engine_error`` too.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("pagoda.frontend.http")
RETRY_AFTER_S = 1  # what a 503 tells the client to wait

# scheduler RequestError codes -> (HTTP status, OpenAI error type)
_ENGINE_CODES: dict[str, tuple[int, str]] = {
    "invalid_request": (400, "invalid_request_error"),
    "too_long": (400, "invalid_request_error"),
    "duplicate_id": (400, "invalid_request_error"),
    "overloaded": (503, "service_unavailable_error"),
    "shutting_down": (503, "service_unavailable_error"),
    "engine_error": (500, "engine_error"),
    # the scheduler dropped a request of this frontend, which it heard nothing from
    "frontend_timeout": (500, "engine_error"),
}


class ApiError(Exception):
    """An HTTP error with an OpenAI body; raise it anywhere in a handler."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code = param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if self.status == 503 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def unavailable(message: str, code: str) -> ApiError:
    return ApiError(503, message, type="service_unavailable_error", code=code)


def from_engine(code: str, message: str) -> ApiError:
    """The HTTP form of a scheduler ``RequestError`` (or a frontend failure)."""
    status, type_ = _ENGINE_CODES.get(code, (500, "engine_error"))
    return ApiError(status, message, type=type_, code=code)


def _validation_message(exc: RequestValidationError) -> ApiError:
    """The first validation error, said the way an API user needs it."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    err = errors[0]
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    kind = err.get("type", "")
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", err.get("msg", ""))
        return bad_request(f"the body is not valid JSON: {detail}")
    if kind == "extra_forbidden" and loc:
        return bad_request(f"unsupported parameter: '{'.'.join(loc)}' is not supported by this "
                           "server", param=loc[0])
    if kind == "missing" and loc:
        return bad_request(f"missing required parameter: '{'.'.join(loc)}'", param=loc[0])
    if not loc:
        return bad_request(f"the body must be a JSON object: {err.get('msg', '')}")
    return bad_request(f"invalid value for '{loc[0]}': {err.get('msg', '')}"
                       + (f" (at {'.'.join(loc)})" if len(loc) > 1 else ""), param=loc[0])


def install_error_handlers(app: FastAPI) -> None:
    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return exc.response()

    async def on_validation(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return _validation_message(exc).response()

    async def on_http(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        if exc.status_code == 413:
            err = ApiError(413, str(exc.detail), code="request_too_large")
        elif exc.status_code == 404:
            err = ApiError(404, f"no such path: {request.url.path}", code="not_found")
        elif exc.status_code == 405:
            err = ApiError(405, f"method {request.method} not allowed on {request.url.path}")
        elif exc.status_code < 500:  # e.g. FastAPI's "error parsing the body"
            err = bad_request(str(exc.detail))
        else:
            err = from_engine("engine_error", str(exc.detail))
        return err.response()

    async def on_unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("HTTP %s %s failed", request.method, request.url.path, exc_info=exc)
        return from_engine("engine_error", "the frontend failed while processing this "
                           "request").response()

    app.add_exception_handler(ApiError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)


MAX_HEADERS = 100  # header fields in one request
MAX_HEADER_BYTES = 32 * 1024  # names and values together (uvicorn's httptools sets none)


class BodyLimitMiddleware:
    """431 for too many or too large headers; 413 for a request body over ``max_bytes``,
    without ever holding more than that.

    A declared Content-Length over the limit is refused before reading anything; a
    chunked body is counted as it arrives and refused when it crosses the limit (the
    ``HTTPException`` raised from ``receive`` passes through FastAPI's body parsing to
    the handler above).
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = scope.get("headers", ())
        if len(headers) > MAX_HEADERS or sum(len(k) + len(v) for k, v in headers) > MAX_HEADER_BYTES:
            await ApiError(431, f"the request headers are over the limit ({MAX_HEADERS} fields, "
                           f"{MAX_HEADER_BYTES} bytes)", code="headers_too_large").response()(
                scope, receive, send)
            return
        limit = self.max_bytes
        too_large = f"the request body is over the limit of {limit} bytes"
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await bad_request("invalid Content-Length header").response()(
                        scope, receive, send)
                    return
                if declared > limit:
                    await ApiError(413, too_large, code="request_too_large").response()(
                        scope, receive, send)
                    return
        seen = 0

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise HTTPException(413, too_large)
            return message

        await self.app(scope, counted_receive, send)
