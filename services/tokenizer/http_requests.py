"""Generation requests of the HTTP API, from validated prompts to a response.

``HttpRequests.generate`` runs one completions or chat request on the ``FrontendCore``:

- validate every prompt first, so a bad request is a 400 and nothing reaches the
  scheduler; then submit them as one ``QueuedRequest`` (its prompts' outputs merged
  into one queue by the output processor, no task per prompt);
- not streaming: collect the outputs while watching the connection; streaming: wait for
  the first output before answering, so a scheduler rejection (``overloaded``) is
  still a proper 503, then SSE chunks and ``data: [DONE]`` (an engine failure
  mid-stream is one error event, then ``[DONE]``);
- a client that closes the connection, before the answer or mid-stream, has its
  requests aborted at the scheduler, which frees their blocks.

Shutdown: ``stop_accepting`` (new requests and ``/health`` get 503), then ``abort_all``
ends in-flight ones with finish_reason "abort".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

import anyio
from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.tokenizer.frontend_core import FrontendCore, QueuedRequest
from services.tokenizer.http_errors import ApiError, bad_request, from_engine, unavailable
from services.tokenizer.input_processor import InvalidRequest, ProcessedPrompt, PromptInput
from services.tokenizer.output_processor import RequestFailed, SampleOutput

log = logging.getLogger("pagoda.frontend.http")
T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client closed the connection before its answer."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """``work``'s result, or ``ClientGone`` as soon as the client closes the connection."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone()


class SseResponse(StreamingResponse):
    """A streamed answer whose ``on_close`` runs however the stream ends."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):  # the abort must go out even when cancelled
                await self._on_close()


class ResponseShape(Protocol):
    """How one API shapes a generation's outputs (OpenAI's ``ResponseBuilder``, the
    Responses and Anthropic Messages APIs): a whole body, or server-sent events."""

    response_id: str

    def whole(self, outputs: Sequence[SampleOutput]) -> dict[str, Any]:
        """The non-streaming body, from each sample's single (final) output."""
        ...

    def events(self, out: SampleOutput) -> list[str]:
        """The SSE text for one streamed output (``sse.sse(...)`` items; may be none)."""
        ...

    def closing_events(self) -> list[str]:
        """The SSE text after the last output (OpenAI: the usage chunk, ``[DONE]``)."""
        ...

    def error_events(self, error: ApiError) -> list[str]:
        """The SSE text that ends a stream the engine failed mid-way."""
        ...


class HttpRequests:
    """The generation requests in flight on one frontend's HTTP API."""

    def __init__(self, core: FrontendCore) -> None:
        self.core = core
        self.accepting = True
        self._inflight: dict[str, QueuedRequest] = {}
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}"

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def new_response_id(self, prefix: str) -> str:
        return f"{prefix}-{self._prefix}-{next(self._ids)}"

    async def abort_all(self) -> None:
        """Shutdown: end every in-flight request; its client gets finish_reason "abort"."""
        for request in list(self._inflight.values()):
            await self.core.abort(request)

    async def close(self) -> None:
        for request in list(self._inflight.values()):
            await self.core.abort(request, deliver=False)
        self._inflight.clear()

    async def generate(self, http_request: Request, prompts: list[PromptInput],
                       builder: ResponseShape, stream: bool,
                       on_whole: Callable[[dict[str, Any]], None] | None = None,
                       on_prompts: Callable[[list[ProcessedPrompt]], None] | None = None,
                       ) -> Response:
        """Run the prompts; the answer shaped by ``builder`` (``on_prompts`` sees the
        validated prompts, ``on_whole`` a whole body before it goes out: the Responses API
        stores it)."""
        if not self.accepting:
            raise unavailable("this frontend is shutting down; retry on another", "shutting_down")
        try:
            processed = await self.core.validate(prompts)  # all valid before any starts
        except InvalidRequest as e:
            raise bad_request(str(e)) from None
        if on_prompts is not None:
            on_prompts(processed)
        num_samples = sum(p.sampling_params.n for p in processed)
        request = QueuedRequest(num_samples)
        response_id = builder.response_id
        self._inflight[response_id] = request
        handed_over, why = False, "the request handler failed"
        try:
            await self.core.submit(processed, stream, request)
            if not stream:
                outputs = await unless_disconnected(http_request, request.collect())
                body = builder.whole(outputs)
                if on_whole is not None:
                    on_whole(body)
                return Response(json.dumps(body, ensure_ascii=False),
                                media_type="application/json")
            first = await unless_disconnected(http_request, request.next())
            handed_over = True
            return SseResponse(self._events(request, builder, first), on_close=lambda: self._close(
                response_id, request, "the client closed the stream"))
        except ClientGone:
            why = "the client disconnected before the answer"
            return Response(status_code=499)  # nobody reads it; the abort is what matters
        except RequestFailed as e:
            why = ""
            raise from_engine(e.code, e.message) from None
        finally:
            if not handed_over:
                await self._close(response_id, request, why)

    async def _close(self, response_id: str, request: QueuedRequest, why: str) -> None:
        """The one way out: abort at the scheduler whatever has not finished, once."""
        if self._inflight.pop(response_id, None) is None:
            return
        unfinished = not request.finished
        # idempotent: only engine requests still held here are aborted (a failed prompt's
        # siblings included)
        await self.core.abort(request, deliver=False)
        if unfinished and why:
            log.warning("HTTP request %s: %s; aborted %d request(s) at the scheduler",
                        response_id, why, len(request.engine_request_ids))

    async def _events(self, request: QueuedRequest, builder: ResponseShape,
                      first: SampleOutput | None) -> AsyncIterator[str]:
        item = first
        try:
            while item is not None:
                for event in builder.events(item):
                    yield event
                item = await request.next()
        except RequestFailed as e:
            for event in builder.error_events(from_engine(e.code, e.message)):
                yield event
            return
        for event in builder.closing_events():
            yield event

    def health(self) -> tuple[bool, str]:
        if not self.accepting:
            return False, "draining: this frontend is shutting down"
        ok, reason = self.core.stats.health()
        return bool(ok), str(reason)

    def metrics(self) -> tuple[bytes, str]:
        body, content_type = self.core.stats.render_metrics()
        return body, content_type
