"""The frontend's OpenAI-compatible HTTP API: uvicorn serving FastAPI on this loop.

A ``FrontendApi`` beside the native API, on the same ``FrontendCore`` (tokenizer,
engine client). Each frontend process binds its own listening socket with
``SO_REUSEPORT`` on ``http_host:http_port``, so several frontends serve one port and
the kernel spreads connections over them; uvicorn gets the bound socket. The routes
are in ``http_app.py``; this module runs generation requests for them:

- validate every prompt first (``RequestRunner.prepare``), so a bad request is a 400
  and nothing reaches the scheduler; then start them (one ``Job``);
- not streaming: collect the outputs while watching the connection; streaming: wait for
  the first output before answering, so a scheduler rejection (``overloaded``) is
  still a proper 503, then SSE chunks and ``data: [DONE]`` (an engine failure
  mid-stream is one error event, then ``[DONE]``);
- a client that closes the connection, before the answer or mid-stream, has its
  requests aborted at the scheduler (``Job.close``), which frees their blocks.

Shutdown (``stop_accepting``): new generation requests and ``/health`` get 503;
``abort_all`` ends in-flight ones with finish_reason "abort"; cancelling ``serve``
closes the listener and lets the answers finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import anyio
import uvicorn
from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from services.tokenizer.http_errors import bad_request, from_engine, unavailable
from services.tokenizer.http_jobs import Job
from services.tokenizer.http_responses import ResponseBuilder
from services.tokenizer.input_processor import InputProcessor, InvalidRequest
from services.tokenizer.request_runner import RequestFailed, RequestRunner
from shared.config import ConfigError, PagodaConfig
from shared.protocol import GenerateRequest

log = logging.getLogger("pagoda.frontend.http")
T = TypeVar("T")
LISTEN_BACKLOG = 2048
GRACEFUL_CLOSE_S = 5.0  # for open connections to finish once serving stops


class ClientGone(Exception):
    """The HTTP client closed the connection before its answer."""


def bind_reuseport(host: str, port: int) -> socket.socket:
    """A listening TCP socket other frontends can bind too (``SO_REUSEPORT``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def served_model_names(model: str) -> list[str]:
    """The ids requests may name: the configured model, then its directory's name.

    ``pagoda serve`` hands the frontends the resolved directory, so an alias such as
    ``smollm2`` is recognised by the cache directory it resolves to.
    """
    from pagoda.model_fetch import ALIASES, default_cache_dir

    names = [model]
    path = os.path.normpath(os.path.expanduser(model))
    for alias, spec in ALIASES.items():
        if path == os.path.normpath(default_cache_dir() / spec.dir_name):
            names.append(alias)
    base = os.path.basename(path)
    if base and base not in names:
        names.append(base)
    return names


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


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class HttpApi:
    """The HTTP API of one frontend process (a ``FrontendApi``)."""

    def __init__(self, core: Any, config: PagodaConfig) -> None:
        from services.tokenizer.http_app import build_app

        proc = config.process
        self.processor: InputProcessor = core.processor
        self.runner = RequestRunner(core.engine, core.processor)
        self.stats = getattr(core, "stats", None)  # EngineStatsView, once it exists
        self.model_names = served_model_names(config.engine.model)
        self.max_model_len = core.processor.limits.max_model_len
        self.accepting = True
        self._jobs: dict[str, Job] = {}
        self._ids = itertools.count()
        self._prefix = f"{os.getpid():x}"
        self.address = f"http://{proc.http_host}:{proc.http_port}"
        if proc.http_host in ("0.0.0.0", "::", "*") and not proc.allow_wildcard_bind:
            raise ConfigError(
                f"refusing to serve HTTP on {proc.http_host}: every interface; use 127.0.0.1 or "
                "allow it explicitly (PAGODA_ALLOW_WILDCARD_BIND=1) behind a firewall or proxy")
        self._sock = bind_reuseport(proc.http_host, proc.http_port)
        app = build_app(self, proc.http_max_body_bytes)
        self._server = uvicorn.Server(uvicorn.Config(
            app, lifespan="off", log_config=None, access_log=False, ws="none",
            timeout_graceful_shutdown=GRACEFUL_CLOSE_S, server_header=False))

    # -- lifecycle (FrontendApi) -------------------------------------------------------------
    @property
    def num_inflight(self) -> int:
        return len(self._jobs)

    def stop_accepting(self) -> None:
        self.accepting = False

    async def abort_all(self) -> None:
        """Shutdown: end every in-flight request; its client gets finish_reason "abort"."""
        ended = [(job, i, run) for job in self._jobs.values() for i, run in job.unended()]
        finals = await self.runner.abort_many([run for _, _, run in ended])
        for (job, i, _), outputs in zip(ended, finals):
            job.end_early(i, outputs)

    async def serve(self) -> None:
        """uvicorn on the bound socket until cancelled (its startup, loop, shutdown
        without ``Server.serve``'s signal handlers: the frontend owns the signals)."""
        server, cfg = self._server, self._server.config
        if not cfg.loaded:
            cfg.load()
        server.lifespan = cfg.lifespan_class(cfg)
        await server.startup(sockets=[self._sock])
        try:
            await server.main_loop()
        finally:
            server.should_exit = True
            await server.shutdown(sockets=[self._sock])

    async def close(self) -> None:
        for job in list(self._jobs.values()):
            await job.close(self.runner)
        self._jobs.clear()
        self._sock.close()

    def discard(self) -> None:
        """Release the listening socket of an API that will never serve."""
        self._sock.close()

    # -- generation ------------------------------------------------------------------------------
    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{self._prefix}-{next(self._ids)}"

    async def generate(self, request: Request, reqs: list[GenerateRequest],
                       builder: ResponseBuilder, stream: bool) -> Response:
        if not self.accepting:
            raise unavailable("this frontend is shutting down; retry on another", "shutting_down")
        try:
            processed = [self.runner.prepare(r) for r in reqs]  # all valid before any starts
        except InvalidRequest as e:
            raise bad_request(str(e)) from None
        job_id = builder.response_id
        runs = []
        for req, p in zip(reqs, processed):
            runs.append(await self.runner.start(p, req.request_id, stream))
        job = Job(job_id, runs)
        self._jobs[job_id] = job
        handed_over, why = False, "the request handler failed"
        try:
            if not stream:
                outputs = await unless_disconnected(request, job.collect())
                return Response(json.dumps(builder.whole(outputs), ensure_ascii=False),
                                media_type="application/json")
            first = await unless_disconnected(request, job.next())
            handed_over = True
            return SseResponse(self._events(job, builder, first),
                               on_close=lambda: self._close(job, "the client closed the stream"))
        except ClientGone:
            why = "the client disconnected before the answer"
            return Response(status_code=499)  # nobody reads it; the abort is what matters
        except RequestFailed as e:
            raise from_engine(e.code, e.message) from None
        finally:
            if not handed_over:
                await self._close(job, why)

    async def _close(self, job: Job, why: str) -> None:
        self._jobs.pop(job.job_id, None)
        await job.close(self.runner, why)

    async def _events(self, job: Job, builder: ResponseBuilder,
                      first: tuple[int, Any] | None) -> AsyncIterator[str]:
        item = first
        try:
            while item is not None:
                for chunk in builder.chunks(*item):
                    yield sse(chunk)
                item = await job.next()
            if builder.include_usage:
                yield sse(builder.usage_chunk())
        except RequestFailed as e:
            yield sse(from_engine(e.code, e.message).body())
        yield "data: [DONE]\n\n"

    # -- the rest of the API ---------------------------------------------------------------------
    def health(self) -> tuple[bool, str]:
        if not self.accepting:
            return False, "draining: this frontend is shutting down"
        if self.stats is not None:
            ok, reason = self.stats.health()
            return bool(ok), str(reason)
        return True, "ok"

    def metrics(self) -> tuple[bytes, str]:
        if self.stats is not None:
            body, content_type = self.stats.render_metrics()
            return body, content_type
        return b"", "text/plain; version=0.0.4; charset=utf-8"
