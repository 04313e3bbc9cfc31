"""The routes of the HTTP API (FastAPI; OpenAPI page at /docs, schema at /openapi.json).

- ``POST /v1/completions``, ``POST /v1/chat/completions``: OpenAI's, streaming or not;
- ``POST /v1/responses``, ``GET|DELETE /v1/responses/{id}``: OpenAI's Responses API
  (``responses_api.py``; stored responses are this process's own);
- ``POST /v1/messages``, ``POST /v1/messages/count_tokens``: Anthropic's Messages API
  (``anthropic_api.py``; errors in Anthropic's shape);
- ``GET /v1/models``: the one model this server runs;
- ``POST /tokenize``, ``POST /detokenize``: vLLM's shapes;
- ``GET /health``: 200 ``ok``, or 503 with the reason (draining, engine unreachable);
- ``GET /metrics``: Prometheus text from the engine figures every frontend receives.

Request bodies are ``http_protocol``'s models (they become ``PromptInput``s); responses
are shaped by ``http_responses``; running requests is ``HttpRequests``'s job
(``http_requests.py``); errors are ``http_errors``'s. The server around the app is
``http_api.py``. Chat requests with ``tools`` go through the core's ``ToolCalling``
(``--tool-call-parser``), which may constrain them and shapes their tool calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse

from services.tokenizer.anthropic_api import install_anthropic_routes
from services.tokenizer.http_auth import ApiKeyMiddleware
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
    chat_turns,
    check_model,
    template_tools,
)
from services.tokenizer.http_requests import HttpRequests
from services.tokenizer.http_responses import ResponseBuilder
from services.tokenizer.input_processor import InputProcessor, InvalidRequest, PromptInput
from services.tokenizer.responses_api import install_responses_routes
from services.tokenizer.responses_store import ResponsesStore
from shared.config import ProcessSettings
from shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class CorsSettings:
    """vLLM's ``--allowed-origins`` and friends (comma-separated in the settings)."""

    allowed_origins: list[str]
    allowed_methods: list[str]
    allowed_headers: list[str]
    allow_credentials: bool = False

    @classmethod
    def from_process(cls, proc: ProcessSettings) -> CorsSettings:
        def items(text: str | None) -> list[str]:
            return [x.strip() for x in (text or "").split(",") if x.strip()]

        return cls(items(proc.allowed_origins), items(proc.allowed_methods),
                   items(proc.allowed_headers), proc.allow_credentials)


def build_app(api: HttpRequests, max_body_bytes: int,
              responses_store: ResponsesStore | None = None,
              api_keys: list[str] | None = None, cors: CorsSettings | None = None,
              open_paths: frozenset[str] = frozenset({"/health", "/metrics", "/tokenize",
                                                      "/detokenize"})) -> FastAPI:
    """The app; ``responses_store`` (default: the default settings' size and TTL) keeps the
    Responses API's finished responses."""
    app = FastAPI(title="pagoda", summary="OpenAI-compatible API of a pagoda frontend")
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)
    if api_keys:  # added after the body limit: outside it, so it runs first
        app.add_middleware(ApiKeyMiddleware, keys=api_keys, open_paths=open_paths)
    if cors is not None and cors.allowed_origins:  # outermost: preflights need no key
        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins,
                           allow_methods=cors.allowed_methods, allow_headers=cors.allowed_headers,
                           allow_credentials=cors.allow_credentials)
    created = int(time.time())
    core = api.core
    processor, tokenizer, model_names = core.processor, core.tokenizer, list(core.served_model_names)
    tool_calling = core.tool_calling

    def model_of(requested: str | None) -> str:
        check_model(requested, model_names)
        return requested or model_names[0]

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        model = model_of(body.model)
        prompts = body.prompt_inputs()
        echo = [_prompt_text(processor, p) for p in prompts] if body.echo else None
        builder = ResponseBuilder("completion", api.new_response_id("cmpl"), model, tokenizer,
                                  body.num_choices, echo=echo,
                                  logprobs=body.logprobs is not None,
                                  include_usage=body.include_usage,
                                  best_of=prompts[0].sampling_params.n,
                                  tokens_as_ids=bool(body.return_tokens_as_token_ids),
                                  generates=body.generates,
                                  return_token_ids=bool(body.return_token_ids),
                                  continuous_usage=body.continuous_usage)
        return await api.generate(request, prompts, builder, bool(body.stream),
                                  on_prompts=builder.set_prompts)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        model = model_of(body.model)
        prompt, tool_calls = body.tool_input(tool_calling)
        builder = ResponseBuilder("chat", api.new_response_id("chatcmpl"), model, tokenizer,
                                  prompt.sampling_params.n, logprobs=bool(body.logprobs),
                                  include_usage=body.include_usage,
                                  tokens_as_ids=bool(body.return_tokens_as_token_ids),
                                  tool_calls=tool_calls, echo=[body.echo_text()],
                                  return_token_ids=bool(body.return_token_ids),
                                  continuous_usage=body.continuous_usage)
        return await api.generate(request, [prompt], builder, bool(body.stream),
                                  on_prompts=builder.set_prompts)

    if responses_store is None:  # (an empty store is falsy: it has a length)
        responses_store = ResponsesStore(ProcessSettings.responses_max_stored,
                                         ProcessSettings.responses_ttl_s)
    install_responses_routes(app, api, model_of, responses_store)
    install_anthropic_routes(app, api)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        name = model_names[0]
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "pagoda",
            "root": name, "parent": None, "max_model_len": core.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        model_of(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("exactly one of prompt and messages must be given")
        def tokens() -> list[int]:
            if body.prompt is not None:
                return processor.tokenize(body.prompt, body.add_special_tokens is not False)
            chat = PromptInput(SamplingParams(), messages=chat_turns(body.messages or []),
                               add_generation_prompt=body.add_generation_prompt,
                               tools=template_tools(body.tools),
                               continue_final_message=body.continue_final_message,
                               chat_template_kwargs=body.chat_template_kwargs)
            return processor.tokenize(processor.render_chat(chat), bool(body.add_special_tokens))

        try:
            token_ids = await core.bounded(tokens)
        except InvalidRequest as e:
            raise bad_request(str(e)) from None
        token_strs = None
        if body.return_token_strs and tokenizer is not None:
            token_strs = tokenizer.convert_ids_to_tokens(token_ids)
        return {"count": len(token_ids), "max_model_len": core.max_model_len,
                "tokens": token_ids, "token_strs": token_strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        model_of(body.model)
        try:
            return {"prompt": processor.detokenize(body.tokens)}
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


def _prompt_text(processor: InputProcessor, req: PromptInput) -> str:
    """What ``echo`` puts before a completion: the prompt as given, or its ids decoded."""
    if req.prompt is not None:
        return req.prompt
    try:
        return processor.detokenize(req.prompt_token_ids or [])
    except InvalidRequest:
        return ""  # out of vocabulary: the request fails validation next anyway
