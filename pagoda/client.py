"""pagoda.client: the native ZMQ client of a pagoda frontend (sync and asyncio).

    with Client("ipc:///run/pagoda/frontend-0.sock") as client:
        result = client.generate("Hello", max_tokens=32, temperature=0)
        for delta in client.stream(messages=[{"role": "user", "content": "Hi"}]):
            print(delta.text, end="")

A client connects a DEALER to one frontend's native-API ROUTER and speaks
``GenerateRequest`` / ``AbortRequest`` out and ``GenerateOutput`` / ``RequestError`` in
(``shared/protocol.py``). Request ids are the client's own, scoped to its connection,
so any number of clients (threads with their own ``Client``, processes) share a
frontend. ``timeout`` bounds a whole request; when it passes, or when a stream is
closed before its end, the client sends an ``AbortRequest`` so the engine frees the
request's KV blocks. Errors are typed: ``InvalidRequestError``, ``OverloadedError``,
``EngineError``, ``RequestTimeoutError``, all ``PagodaError``.

This module imports no torch: clients stay light. A ``Client`` is not thread-safe
(ZMQ sockets are not); an ``AsyncClient`` serves any number of concurrent requests
on its event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import zmq
import zmq.asyncio

from shared.codec import EncodeError, MalformedFrameCounter, encode, safe_decode
from shared.curve import CurveKeys
from shared.ipc import make_socket
from shared.protocol import (
    FRONTEND_TO_CLIENT,
    AbortRequest,
    ChatMessage,
    GenerateOutput,
    GenerateRequest,
    RequestError,
    TokenLogprobs,
    ToolCall,
    ToolFunction,
)
from shared.sampling_params import SamplingParams

__all__ = [
    "AsyncClient", "Client", "EngineError", "GenerateOutput", "GenerateResult",
    "InvalidRequestError", "OverloadedError", "PagodaError", "RequestTimeoutError",
    "SampleOutput", "Usage",
]

DEFAULT_TIMEOUT_S = 300.0


class PagodaError(Exception):
    """Any error a pagoda frontend reported, or the client raised for a request."""

    def __init__(self, message: str, code: str = "engine_error", request_id: str | None = None):
        super().__init__(message)
        self.code = code
        self.request_id = request_id


class InvalidRequestError(PagodaError, ValueError):
    """The request was wrong (code ``invalid_request`` or ``too_long``); do not retry it."""


class OverloadedError(PagodaError):
    """The engine or this frontend refuses new work for now; retry later or elsewhere."""


class EngineError(PagodaError):
    """The engine failed while serving the request."""


class RequestTimeoutError(PagodaError, TimeoutError):
    """No complete answer within the timeout; the request was aborted."""


_ERRORS: dict[str, type[PagodaError]] = {
    "invalid_request": InvalidRequestError, "too_long": InvalidRequestError,
    "duplicate_id": InvalidRequestError, "overloaded": OverloadedError,
    "shutting_down": OverloadedError,  # the scheduler is stopping: retry elsewhere/later
}


def _error(err: RequestError) -> PagodaError:
    return _ERRORS.get(err.code, EngineError)(err.message, err.code, err.request_id)


@dataclass
class SampleOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: str | None = None  # the stop string, or the stop token id as text
    logprobs: list[TokenLogprobs | None] | None = None  # when asked for
    # with tools: the calls the model made (``text`` is then the rest of its answer)
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0  # over all samples
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


@dataclass
class GenerateResult:
    request_id: str
    outputs: list[SampleOutput]
    usage: Usage
    # with prompt_logprobs: the prompt's token ids and each one's logprobs (the first None)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class _Collector:
    """Folds a request's GenerateOutputs (deltas or whole samples) into a GenerateResult."""

    def __init__(self, req: GenerateRequest) -> None:
        self.request_id = req.request_id
        self._want_logprobs = req.sampling_params.logprobs is not None
        self.samples = [SampleOutput(i, logprobs=[] if self._want_logprobs else None)
                        for i in range(req.sampling_params.n)]
        self._text: list[list[str]] = [[] for _ in self.samples]
        self._completion: list[int] = [0] * len(self.samples)
        self.usage = Usage()
        self.prompt_token_ids: list[int] | None = None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def done(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def add(self, out: GenerateOutput) -> None:
        if not 0 <= out.index < len(self.samples):
            return
        s = self.samples[out.index]
        self._text[out.index].append(out.text)
        s.token_ids.extend(out.token_ids)
        if s.logprobs is not None:
            s.logprobs.extend(out.logprobs)
        for piece in out.tool_calls:
            if piece.index >= len(s.tool_calls):
                s.tool_calls.append(ToolCall(piece.index, piece.id, piece.name, piece.arguments))
            else:
                call = s.tool_calls[piece.index]
                call.id, call.name = call.id or piece.id, call.name or piece.name
                call.arguments += piece.arguments
        if out.finish_reason is not None:
            s.finish_reason, s.stop_reason = out.finish_reason, out.stop_reason
        self._completion[out.index] = out.num_output_tokens
        self.usage.prompt_tokens = out.num_prompt_tokens
        self.usage.completion_tokens = sum(self._completion)
        self.usage.cached_tokens = max(self.usage.cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs and self.prompt_logprobs is None:
            self.prompt_token_ids, self.prompt_logprobs = out.prompt_token_ids, out.prompt_logprobs

    def result(self) -> GenerateResult:
        for s, parts in zip(self.samples, self._text):
            s.text = "".join(parts)
        return GenerateResult(self.request_id, self.samples, self.usage, self.prompt_token_ids,
                              self.prompt_logprobs)


Message = Mapping[str, Any] | ChatMessage
PROMPT_OPTIONS = ("add_special_tokens", "continue_final_message", "chat_template_kwargs")
Tool = Mapping[str, Any] | ToolFunction


def _build_request(
    request_id: str,
    prompt: str | Sequence[int] | None,
    messages: Sequence[Message] | None,
    stream: bool,
    sampling: dict[str, Any],
) -> GenerateRequest:
    """A GenerateRequest, or InvalidRequestError for what the client can see is wrong.

    Besides the ``SamplingParams`` fields, ``sampling`` may hold ``add_generation_prompt``,
    vLLM's ``add_special_tokens``, ``continue_final_message`` and ``chat_template_kwargs``
    and, with ``messages``, OpenAI's ``tools`` (function tools, as dicts or
    ``ToolFunction``s), ``tool_choice`` ("none", "auto", "required" or
    ``{"type": "function", "function": {"name": ...}}``) and ``parallel_tool_calls``.
    """
    add_generation_prompt = bool(sampling.pop("add_generation_prompt", True))
    prompt_options = {k: sampling.pop(k) for k in PROMPT_OPTIONS if k in sampling}
    tools = sampling.pop("tools", None) or []
    tool_choice = sampling.pop("tool_choice", None)
    parallel_tool_calls = bool(sampling.pop("parallel_tool_calls", True))
    try:
        params = SamplingParams.from_dict(sampling)
        req = GenerateRequest(request_id, params, stream=stream,
                              add_generation_prompt=add_generation_prompt,
                              tools=[_tool(t) for t in tools],
                              parallel_tool_calls=parallel_tool_calls, **prompt_options)
        if isinstance(tool_choice, Mapping):
            req.tool_choice, req.tool_function = "function", tool_choice["function"]["name"]
        else:
            req.tool_choice = tool_choice
    except (ValueError, TypeError, KeyError) as e:
        raise InvalidRequestError(f"{type(e).__name__}: {e}" if isinstance(e, KeyError) else str(e),
                                  "invalid_request", request_id) from None
    if isinstance(prompt, str):
        req.prompt = prompt
    elif prompt is not None:
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("prompt must be a string or a list of token ids",
                                      "invalid_request", request_id)
        req.prompt_token_ids = list(prompt)
    if messages is not None:
        try:
            req.messages = [m if isinstance(m, ChatMessage) else _message(m) for m in messages]
        except (KeyError, TypeError):
            raise InvalidRequestError(
                "messages must be {'role': str, 'content': str | None, 'tool_calls': [...], "
                "'tool_call_id': str} items", "invalid_request", request_id) from None
    if (prompt is None) == (messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", "invalid_request",
                                  request_id)
    try:
        # a negative or huge token id, a non-str content, an unknown tool_choice: refused
        encode(req, validate=True)
    except EncodeError as e:
        raise InvalidRequestError(str(e), "invalid_request", request_id) from None
    return req


def _tool(tool: Tool) -> ToolFunction:
    if isinstance(tool, ToolFunction):
        return tool
    fn = tool["function"]
    return ToolFunction(fn["name"], fn.get("description"), fn.get("parameters"))


def _message(m: Mapping[str, Any]) -> ChatMessage:
    """An OpenAI-shaped chat message (assistant ``tool_calls``, tool ``tool_call_id``)."""
    calls = [ToolCall(i, c.get("id"), c["function"]["name"], c["function"]["arguments"])
             for i, c in enumerate(m.get("tool_calls") or ())]
    return ChatMessage(m["role"], m["content"], calls, m.get("tool_call_id"), m.get("name"))


def _curve(directory: str | Path | None) -> CurveKeys | None:
    """CURVE keys for a frontend that runs with ``--curve-keys``: the directory needs
    ``server.key`` and ``client.key_secret`` (a key in the frontend's allow-list)."""
    return None if directory is None else CurveKeys.load(directory)


class _Base:
    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.counter = MalformedFrameCounter()  # frames from the frontend that were dropped
        self._prefix = uuid.uuid4().hex[:8]
        self._ids = itertools.count()

    def _new_id(self, request_id: str | None) -> str:
        return request_id if request_id is not None else f"{self._prefix}-{next(self._ids)}"

    def _deadline(self, timeout: float | None | object) -> float | None:
        t = self.timeout if timeout is _DEFAULT else timeout
        return None if t is None else time.monotonic() + float(t)  # type: ignore[arg-type]


_DEFAULT: Any = object()  # "use the client's timeout"


class Client(_Base):
    """A blocking client of one frontend. Not thread-safe: one per thread."""

    def __init__(self, address: str, timeout: float | None = DEFAULT_TIMEOUT_S, *,
                 curve_keys: str | Path | None = None) -> None:
        super().__init__(timeout)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER, address, curve=_curve(curve_keys))
        self._buffers: dict[str, deque[GenerateOutput | RequestError]] = {}

    def generate(self, prompt: str | Sequence[int] | None = None, *,
                 messages: Sequence[Message] | None = None,
                 timeout: float | None = _DEFAULT, request_id: str | None = None,
                 **sampling: Any) -> GenerateResult:
        req = _build_request(self._new_id(request_id), prompt, messages, False, sampling)
        collector = _Collector(req)
        for out in self._exchange(req, self._deadline(timeout)):
            collector.add(out)
        return collector.result()

    def stream(self, prompt: str | Sequence[int] | None = None, *,
               messages: Sequence[Message] | None = None,
               timeout: float | None = _DEFAULT, request_id: str | None = None,
               **sampling: Any) -> Iterator[GenerateOutput]:
        """Deltas as they come; validated now, sent at the first ``next()``."""
        req = _build_request(self._new_id(request_id), prompt, messages, True, sampling)
        return self._exchange(req, self._deadline(timeout))

    def abort(self, request_id: str) -> None:
        """Asks the frontend to drop the request; RequestTimeoutError where the socket
        takes no message within the client's timeout."""
        self._send(encode(AbortRequest([request_id])), request_id, self._deadline(_DEFAULT))

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _exchange(self, req: GenerateRequest, deadline: float | None) -> Iterator[GenerateOutput]:
        rid, n = req.request_id, req.sampling_params.n
        self._buffers[rid] = deque()
        finished: set[int] = set()
        complete = False
        try:
            self._send(encode(req), rid, deadline)
            while len(finished) < n:
                msg = self._next(rid, deadline)
                if isinstance(msg, RequestError):
                    complete = True  # the frontend holds nothing for it any more
                    raise _error(msg)
                if msg.finish_reason is not None:
                    finished.add(msg.index)
                yield msg
            complete = True
        finally:
            del self._buffers[rid]
            if not complete:  # closed early, timed out or failed: free the engine's blocks
                self._abort_nowait(rid)

    def _send(self, frame: bytes, rid: str, deadline: float | None) -> None:
        """Sends once the socket takes the frame, by the deadline: a DEALER left without a
        pipe (the frontend refused our CURVE handshake, or no connection yet under
        ZMQ_IMMEDIATE) would block a plain send for ever."""
        while True:
            wait_ms = (None if deadline is None
                       else max(0, int((deadline - time.monotonic()) * 1000)))
            if self._sock.poll(wait_ms, zmq.POLLOUT):
                try:
                    self._sock.send(frame, flags=zmq.NOBLOCK)
                    return
                except zmq.Again:
                    # the pipe went between poll and send (a refused handshake drops the
                    # pipe each reconnect makes): wait for the next one, by the same deadline
                    if wait_ms != 0:
                        continue
            raise RequestTimeoutError(f"request {rid} timed out: the frontend took no message",
                                      "timeout", rid)

    def _next(self, rid: str, deadline: float | None) -> GenerateOutput | RequestError:
        buf = self._buffers[rid]
        while not buf:
            wait_ms = -1 if deadline is None else int((deadline - time.monotonic()) * 1000)
            if deadline is not None and wait_ms <= 0:
                raise RequestTimeoutError(f"request {rid} timed out", "timeout", rid)
            if self._sock.poll(wait_ms if wait_ms >= 0 else None, zmq.POLLIN):
                self._route(self._sock.recv_multipart(copy=False))
        return buf.popleft()

    def _route(self, frames: list[Any]) -> None:
        msg = safe_decode(frames, FRONTEND_TO_CLIENT, self.counter)
        if msg is not None and (buf := self._buffers.get(msg.request_id)) is not None:
            buf.append(msg)  # replies for requests no longer awaited are dropped

    def _abort_nowait(self, rid: str) -> None:
        try:
            self._sock.send(encode(AbortRequest([rid])), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the frontend's pipe is full or gone; it aborts on our disconnect anyway


class AsyncClient(_Base):
    """An asyncio client of one frontend; concurrent requests share one socket."""

    def __init__(self, address: str, timeout: float | None = DEFAULT_TIMEOUT_S, *,
                 curve_keys: str | Path | None = None) -> None:
        super().__init__(timeout)
        self._ctx = zmq.asyncio.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER, address, curve=_curve(curve_keys))
        self._queues: dict[str, asyncio.Queue[GenerateOutput | RequestError]] = {}
        self._recv_task: asyncio.Task[None] | None = None

    async def generate(self, prompt: str | Sequence[int] | None = None, *,
                       messages: Sequence[Message] | None = None,
                       timeout: float | None = _DEFAULT, request_id: str | None = None,
                       **sampling: Any) -> GenerateResult:
        req = _build_request(self._new_id(request_id), prompt, messages, False, sampling)
        collector = _Collector(req)
        async for out in AsyncStream(self, req, self._deadline(timeout)):
            collector.add(out)
        return collector.result()

    def stream(self, prompt: str | Sequence[int] | None = None, *,
               messages: Sequence[Message] | None = None,
               timeout: float | None = _DEFAULT, request_id: str | None = None,
               **sampling: Any) -> AsyncStream:
        """``async for delta in client.stream(...)``; ``async with`` closes it early safely."""
        req = _build_request(self._new_id(request_id), prompt, messages, True, sampling)
        return AsyncStream(self, req, self._deadline(timeout))

    async def abort(self, request_id: str) -> None:
        """Asks the frontend to drop the request; RequestTimeoutError where the socket
        takes no message within the client's timeout."""
        try:
            await asyncio.wait_for(self._sock.send(encode(AbortRequest([request_id]))),
                                   self.timeout)
        except TimeoutError:
            raise RequestTimeoutError(f"abort of {request_id} timed out: the frontend took "
                                      "no message", "timeout", request_id) from None

    async def close(self) -> None:
        if self._recv_task is not None:
            self._recv_task.cancel()
            await asyncio.gather(self._recv_task, return_exceptions=True)
            self._recv_task = None
        self._sock.close()
        self._ctx.term()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _register(self, rid: str) -> asyncio.Queue[GenerateOutput | RequestError]:
        if self._recv_task is None or self._recv_task.done():
            self._recv_task = asyncio.get_running_loop().create_task(self._receive_loop())
        queue: asyncio.Queue[GenerateOutput | RequestError] = asyncio.Queue()
        self._queues[rid] = queue
        return queue

    async def _receive_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            msg = safe_decode(frames, FRONTEND_TO_CLIENT, self.counter)
            if msg is not None and (queue := self._queues.get(msg.request_id)) is not None:
                queue.put_nowait(msg)

    def _abort_nowait(self, rid: str) -> None:
        self._queues.pop(rid, None)
        try:  # the plain (synchronous) send: callable from close() and __del__ alike
            zmq.Socket.send(self._sock, encode(AbortRequest([rid])), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass


class AsyncStream(AsyncIterator[GenerateOutput]):
    """The deltas of one request; aborts it when closed (or collected) before its end."""

    def __init__(self, client: AsyncClient, req: GenerateRequest, deadline: float | None) -> None:
        self._client, self._req, self._deadline = client, req, deadline
        self.request_id = req.request_id
        self._queue: asyncio.Queue[GenerateOutput | RequestError] | None = None
        self._finished: set[int] = set()
        self._open = False  # sent and not yet complete

    def _remaining(self) -> float | None:
        remaining = None if self._deadline is None else self._deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            raise TimeoutError
        return remaining

    async def __anext__(self) -> GenerateOutput:
        if self._queue is not None and not self._open:
            raise StopAsyncIteration  # complete, failed or closed
        try:
            if self._queue is None:
                self._queue = self._client._register(self.request_id)
                self._open = True
                # by the deadline too: a socket without a pipe (a refused CURVE handshake)
                # would hold the send for ever
                await asyncio.wait_for(self._client._sock.send(encode(self._req)),
                                       self._remaining())
            msg = await asyncio.wait_for(self._queue.get(), self._remaining())
        except TimeoutError:
            await self.aclose()
            raise RequestTimeoutError(f"request {self.request_id} timed out", "timeout",
                                      self.request_id) from None
        if isinstance(msg, RequestError):
            self._end(abort=False)
            raise _error(msg)
        if msg.finish_reason is not None:
            self._finished.add(msg.index)
            if len(self._finished) >= self._req.sampling_params.n:
                self._end(abort=False)
        return msg

    async def aclose(self) -> None:
        self._end(abort=True)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _end(self, abort: bool) -> None:
        if self._open:
            self._open = False
            if abort:
                self._client._abort_nowait(self.request_id)
            else:
                self._client._queues.pop(self.request_id, None)

    def __del__(self) -> None:
        if self._open:  # abandoned mid-stream (a `break` without `async with`)
            # a finalizer must not raise, whatever state the loop or socket is in
            with contextlib.suppress(Exception):
                self._end(abort=True)
