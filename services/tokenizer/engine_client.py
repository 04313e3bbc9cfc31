"""The frontend's link to the scheduler: a DEALER, asyncio, one queue per request.

The scheduler binds a ROUTER; this frontend connects a DEALER whose ZMQ identity is
its frontend id, so the scheduler knows which frontend owns each request and sends
each step's outputs (``RequestOutputs``) back to it alone. Request ids sent upstream
are minted here from a counter: unique per frontend, which is all the scheduler needs
since it scopes ids by frontend identity. Client ids never cross this link.

``add`` sends an ``AddRequest`` and returns an ``EngineRequest`` whose queue receives
that request's ``RequestOutput``s (or one ``RequestError``); ``abort`` sends an
``AbortRequest``. One receive task decodes with ``safe_decode`` and never raises:
malformed frames are dropped and counted, outputs for ids no longer held (aborted
here, the scheduler catching up) are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from shared.codec import MalformedFrameCounter, encode, safe_decode
from shared.ipc import make_socket
from services.tokenizer.engine_stats import EngineStatsView
from shared.protocol import (
    SCHEDULER_TO_FRONTEND,
    AbortRequest,
    AddRequest,
    EngineStats,
    Heartbeat,
    RequestError,
    RequestOutput,
    RequestOutputs,
)
from shared.sampling_params import SamplingParams

log = logging.getLogger("pagoda.frontend.engine")
HEARTBEAT_S = 1.0

EngineEvent = RequestOutput | RequestError


@dataclass
class EngineRequest:
    """A request held at the scheduler; read its outputs with ``await get()``."""

    request_id: str
    num_samples: int
    queue: asyncio.Queue[EngineEvent] = field(default_factory=asyncio.Queue)
    finished_indices: set[int] = field(default_factory=set)

    async def get(self) -> EngineEvent:
        return await self.queue.get()

    @property
    def finished(self) -> bool:
        return len(self.finished_indices) >= self.num_samples


class EngineClient:
    """The DEALER side of the frontend <-> scheduler link."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        frontend_id: str,
        counter: MalformedFrameCounter,
        *,
        hwm: int | None = None,
        stats: EngineStatsView | None = None,
        heartbeat_s: float = HEARTBEAT_S,
    ) -> None:
        self.frontend_id = frontend_id
        self.stats = stats
        self._heartbeat_s = heartbeat_s
        self._heartbeat_task: asyncio.Task[None] | None = None
        opts: dict[str, Any] = {} if hwm is None else {"sndhwm": hwm, "rcvhwm": hwm}
        self._sock = make_socket(ctx, zmq.DEALER, address, identity=frontend_id.encode(), **opts)
        self._counter = counter
        self._requests: dict[str, EngineRequest] = {}
        self._ids = itertools.count()
        self._recv_task: asyncio.Task[None] | None = None

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> None:
        """Start the receive task (in the running loop)."""
        loop = asyncio.get_running_loop()
        if self._recv_task is None:
            self._recv_task = loop.create_task(self._receive_loop(), name="engine-client-recv")
        if self._heartbeat_task is None:
            self._heartbeat_task = loop.create_task(self._heartbeat_loop(), name="engine-client-heartbeat")

    async def close(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
            self._heartbeat_task = None
        if self._recv_task is not None:
            self._recv_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._recv_task
            self._recv_task = None
        self._sock.close()  # linger (make_socket) lets queued aborts reach the scheduler

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    # -- requests -------------------------------------------------------------------------
    async def add(
        self, prompt_token_ids: list[int], sampling_params: SamplingParams, *, priority: int = 0
    ) -> EngineRequest:
        request_id = str(next(self._ids))
        req = EngineRequest(request_id, sampling_params.n)
        # registered before the send, so no output can arrive for an id we do not hold
        self._requests[request_id] = req
        msg = AddRequest(request_id, prompt_token_ids, sampling_params, time.time(), priority)
        try:
            await self._sock.send(encode(msg))
        except BaseException:
            self._requests.pop(request_id, None)
            raise
        return req

    async def abort(self, request_ids: list[str], index: int | None = None) -> None:
        """Abort requests (or one sample of each) at the scheduler; stop holding them.

        Whole requests are dropped at once: later outputs for them are ignored. A single
        sample counts as finished here; the request is dropped when all samples are.
        """
        held = [r for r in request_ids if r in self._requests]
        if not held:
            return
        for rid in held:
            if index is None:
                del self._requests[rid]
            else:
                self._mark_finished(self._requests[rid], index)
        await self._sock.send(encode(AbortRequest(held, index)))

    async def _heartbeat_loop(self) -> None:
        """Liveness both ways: the scheduler answers with EngineStats (our /health and
        /metrics) and drops the requests of a frontend that falls silent."""
        beat = encode(Heartbeat(self.frontend_id))
        while True:
            try:
                await self._sock.send(beat, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # the scheduler is not reading; health goes stale on its own
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM:
                    return
                log.warning("heartbeat send failed: %s", e)
            await asyncio.sleep(self._heartbeat_s)  # a period, not a synchronisation

    # -- receive --------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        while True:
            try:
                frames = await self._sock.recv_multipart(copy=False)
            except asyncio.CancelledError:
                raise
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM:
                    return
                log.warning("scheduler link receive failed: %s", e)
                continue
            msg = safe_decode(frames, SCHEDULER_TO_FRONTEND, self._counter)
            if msg is not None:
                self._dispatch(msg)

    def _dispatch(self, msg: RequestOutputs | RequestError | EngineStats) -> None:
        if isinstance(msg, EngineStats):
            if self.stats is not None:
                self.stats.update(msg)
            return
        if isinstance(msg, RequestError):
            if msg.code == "engine_error" and self.stats is not None:
                self.stats.mark_engine_dead(msg.message)
            req = self._requests.pop(msg.request_id, None)
            if req is not None:
                req.queue.put_nowait(msg)
            return
        for out in msg.outputs:
            req = self._requests.get(out.request_id)
            if req is None:
                continue  # aborted here already, or not ours
            req.queue.put_nowait(out)
            if out.finish_reason is not None:
                self._mark_finished(req, out.index)

    def _mark_finished(self, req: EngineRequest, index: int) -> None:
        if 0 <= index < req.num_samples:
            req.finished_indices.add(index)
        if req.finished:
            self._requests.pop(req.request_id, None)
