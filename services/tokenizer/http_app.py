"""The routes of the HTTP API (FastAPI; OpenAPI page at /docs, schema at /openapi.json).

- ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI's, streaming or not;
- ``GET /v1/models``: the one model this server runs;
- ``POST /tokenize``, ``POST /detokenize``: vLLM's shapes;
- ``GET /health``: 200 ``ok``, or 503 with the reason (draining, engine unreachable);
- ``GET /metrics``: Prometheus text from the engine figures every frontend receives.

Request bodies are ``http_protocol``'s models; responses are shaped by
``http_responses``; running requests is ``HttpApi``'s job; errors are ``http_errors``'s.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from services.tokenizer.http_errors import (
    BodyLimitMiddleware,
    bad_request,
    install_error_handlers,
    unavailable,
)
from services.tokenizer.http_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_model,
)
from services.tokenizer.http_responses import ResponseBuilder
from services.tokenizer.input_processor import InvalidRequest
from shared.protocol import ChatMessage, GenerateRequest
from shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.tokenizer.http_api import HttpApi


def build_app(api: HttpApi, max_body_bytes: int) -> FastAPI:
    app = FastAPI(title="pagoda", summary="OpenAI-compatible API of a pagoda frontend")
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    created = int(time.time())
    tokenizer = api.processor.tokenizer

    def model_of(requested: str | None) -> str:
        check_model(requested, api.model_names)
        return requested or api.model_names[0]

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model = model_of(body.model)
        response_id = api.new_request_id("cmpl")
        reqs = body.generate_requests(response_id)
        echo = [_prompt_text(api, r) for r in reqs] if body.echo else None
        builder = ResponseBuilder("completion", response_id, model, tokenizer,
                                  reqs[0].sampling_params.n, echo=echo,
                                  logprobs=body.logprobs is not None,
                                  include_usage=body.include_usage)
        return await api.generate(request, reqs, builder, bool(body.stream))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        model = model_of(body.model)
        response_id = api.new_request_id("chatcmpl")
        req = body.generate_request(response_id)
        builder = ResponseBuilder("chat", response_id, model, tokenizer, req.sampling_params.n,
                                  logprobs=bool(body.logprobs), include_usage=body.include_usage)
        return await api.generate(request, [req], builder, bool(body.stream))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        name = api.model_names[0]
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "pagoda",
            "root": name, "parent": None, "max_model_len": api.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        model_of(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("exactly one of prompt and messages must be given")
        try:
            if body.prompt is not None:
                token_ids = api.processor.tokenize(body.prompt)
            else:
                req = GenerateRequest("tokenize", SamplingParams(), add_generation_prompt=(
                    body.add_generation_prompt), messages=[
                    ChatMessage(m.role, m.text()) for m in body.messages or []])
                token_ids = api.processor.tokenize(api.processor.render_chat(req))
        except InvalidRequest as e:
            raise bad_request(str(e)) from None
        return {"count": len(token_ids), "max_model_len": api.max_model_len,
                "tokens": token_ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        model_of(body.model)
        try:
            return {"prompt": api.processor.detokenize(body.tokens)}
        except InvalidRequest as e:
            raise bad_request(str(e), "tokens") from None

    @app.get("/health", response_class=PlainTextResponse)
    async def health() -> Response:
        ok, reason = api.health()
        if not ok:
            return unavailable(f"unhealthy: {reason}", "unhealthy").response()
        return PlainTextResponse("ok")

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = api.metrics()
        return Response(body, media_type=content_type)

    @app.get("/", include_in_schema=False)
    async def root() -> JSONResponse:
        return JSONResponse({"message": "pagoda: OpenAI-compatible API under /v1; see /docs"})

    return app


def _prompt_text(api: HttpApi, req: GenerateRequest) -> str:
    """What ``echo`` puts before a completion: the prompt as given, or its ids decoded."""
    if req.prompt is not None:
        return req.prompt
    try:
        return api.processor.detokenize(req.prompt_token_ids or [])
    except InvalidRequest:
        return ""  # out of vocabulary: the request fails validation next anyway
