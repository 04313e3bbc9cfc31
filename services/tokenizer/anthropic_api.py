"""Anthropic's Messages API on the HTTP app: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` (what the ``anthropic`` SDK and Claude Code call).

A request runs like a chat completion: the body (``anthropic_protocol``) becomes one
``PromptInput`` (with ``ToolCalling``'s constraint or parser when it has tools), which
``HttpRequests.generate`` runs and ``anthropic_responses.MessagesShape`` shapes.

Every error of these routes leaves in Anthropic's shape, ``{"type": "error", "error":
{"type", "message"}}``: 400 ``invalid_request_error`` (the body is validated here from
the raw JSON, so pydantic's errors do not reach the app's OpenAI-shaped handlers), 404
``not_found_error`` (unknown model), 413 ``request_too_large`` (a chunked body over the
limit; a declared Content-Length over it is refused before any route, in OpenAI's shape),
529 ``overloaded_error`` + ``Retry-After`` when the scheduler's queue is full, 503
``overloaded_error`` while this frontend shuts down, 500 ``api_error``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.tokenizer.anthropic_protocol import (
    BLOCK_TYPES,
    CountTokensRequest,
    MessagesRequest,
)
from services.tokenizer.anthropic_responses import MessagesShape, error_body, error_type
from services.tokenizer.http_errors import RETRY_AFTER_S, ApiError, bad_request
from services.tokenizer.http_protocol import check_model, check_text
from services.tokenizer.http_requests import HttpRequests
from services.tokenizer.input_processor import InvalidRequest

log = logging.getLogger("pagoda.frontend.http")
Body = TypeVar("Body", bound=BaseModel)
# the body is read by the route, so the OpenAPI page gets its shape from here
_JSON_BODY = {"requestBody": {"required": True, "content": {"application/json": {
    "schema": {"type": "object", "description": "Anthropic's Messages API request body"}}}}}


def install_anthropic_routes(app: FastAPI, api: HttpRequests) -> None:
    core = api.core
    model_names = list(core.served_model_names)

    @app.post("/v1/messages", openapi_extra=_JSON_BODY, summary="Anthropic Messages API")
    async def messages(request: Request) -> Response:
        try:
            body = await _read(request, MessagesRequest)
            check_model(body.model, model_names)
            prompt, tool_calls, clamped = body.prompt_input(core.processor, core.tool_calling)
            shape = MessagesShape(api.new_response_id("msg").replace("-", "_"), body.model,
                                  tool_calls, clamped)
            return await api.generate(request, [prompt], shape, bool(body.stream))
        except ApiError as e:
            return error_response(e)
        except Exception as e:  # noqa: BLE001 -- answered in this API's shape, as the app's handler would
            return _unexpected(request, e)

    @app.post("/v1/messages/count_tokens", openapi_extra=_JSON_BODY,
              summary="Anthropic Messages API: the prompt's tokens")
    async def count_tokens(request: Request) -> Response:
        try:
            body = await _read(request, CountTokensRequest)
            check_model(body.model, model_names)
            try:
                count = await core.bounded(body.num_tokens, core.processor)
            except InvalidRequest as e:  # the deadline
                raise bad_request(str(e)) from None
            return JSONResponse({"input_tokens": count})
        except ApiError as e:
            return error_response(e)
        except Exception as e:  # noqa: BLE001 -- as above
            return _unexpected(request, e)


def error_response(error: ApiError) -> JSONResponse:
    status, kind = error_type(error)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (503, 529) else None
    return JSONResponse(error_body(kind, error.message), status_code=status, headers=headers)


def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("HTTP %s %s failed", request.method, request.url.path, exc_info=exc)
    return JSONResponse(error_body("api_error", "the frontend failed while processing this "
                                   "request"), status_code=500)


async def _read(request: Request, model: type[Body]) -> Body:
    """The body as ``model``, or an ``ApiError`` saying what is wrong with it."""
    try:
        raw = await request.body()
    except StarletteHTTPException as e:  # the body limit, counted as the body arrives
        raise ApiError(e.status_code, str(e.detail)) from None
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise bad_request(f"the body is not valid JSON: {e}") from None
    check_text(data)  # JSON's "\ud800" parses, but cannot be encoded or tokenized
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _invalid(e) from None


def _invalid(exc: ValidationError) -> ApiError:
    """The most specific validation error, said the way an API user needs it."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    err = max(errors, key=lambda e: len(_path(e["loc"])))  # the deepest: the others are
    path = _path(err["loc"])  # the union branches the value was not meant for
    kind, ctx = err["type"], err.get("ctx") or {}
    if not path:
        return bad_request(f"the body must be a JSON object: {err['msg']}")
    if kind == "union_tag_invalid":
        return bad_request(f"{path}: content blocks of type {ctx.get('tag')!r} are not "
                           f"supported by this server (it takes {', '.join(BLOCK_TYPES)})")
    if kind == "extra_forbidden":
        return bad_request(f"unsupported parameter: '{path}' is not supported by this server")
    if kind == "missing":
        return bad_request(f"missing required parameter: '{path}'")
    return bad_request(f"{path}: {err['msg']}")


def _path(loc: tuple[Any, ...]) -> str:
    """``messages[0].content[1].input`` from pydantic's location, without the names of
    union branches (``str``, ``list[...]``) and of block types (a tagged union's tag)."""
    path = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
            continue
        branch = part in ("str", "int", "float", "bool") or "[" in part
        tag = part in BLOCK_TYPES and i > 0 and isinstance(loc[i - 1], int)
        if not (branch or tag):
            path += f".{part}" if path else part
    return path
