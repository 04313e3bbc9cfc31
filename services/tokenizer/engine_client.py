"""The frontend's link to the scheduler: a DEALER, asyncio, feeding the output processor.

The scheduler binds a ROUTER; this frontend connects a DEALER whose ZMQ identity is
its frontend id, so the scheduler knows which frontend owns each request and sends
each step's outputs (``EngineOutputs``) back to it alone. Request ids sent upstream
are minted here from a counter: unique per frontend, which is all the scheduler needs
since it scopes ids by frontend identity. Client ids never cross this link.

``add`` registers a ``RequestState`` with the ``OutputProcessor`` and sends an
``AddRequest``; ``abort`` ends samples here and sends an ``AbortRequest``. One receive
task decodes with ``safe_decode`` (never raises: malformed frames are dropped and
counted) and hands each step's outputs straight to the output processor, which puts
them into their client requests' sinks; samples a stop string ended are aborted
upstream from here. A ``RequestError`` fails its request's sink; an ``engine_error``
(per request, or engine-wide with an empty id) marks the engine dead for /health.

The scheduler answers every heartbeat (1 s apart) with ``EngineStats``, even mid-step, so
silence means it is gone (killed, hung, unreachable): after ``SCHEDULER_SILENCE_S``
without a word while requests are in flight, every one of them fails with
``engine_error`` here (its client gets a 500, or an SSE error event then ``[DONE]``)
instead of waiting for outputs that will never come.

Until the scheduler has answered once, the engine is starting (a worker loads its model
and may compile its kernels first, a minute on a fresh machine): requests sent meanwhile
wait in the DEALER's queue, which ZMQ delivers once the scheduler binds, and are served
then. Only past ``startup_s`` (the process's ``startup_timeout_s``) from this client's
start do they fail, saying the engine did not start. /health answers 503 ("no answer from
the scheduler yet") all that time.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from services.tokenizer.engine_stats import EngineStatsView
from services.tokenizer.output_processor import OutputProcessor, RequestState
from shared.codec import MalformedFrameCounter, encode, safe_decode
from shared.config import ProcessSettings
from shared.curve import CurveKeys
from shared.faults import FaultPoint
from shared.ipc import make_socket
from shared.protocol import (
    SCHEDULER_TO_FRONTEND,
    AbortRequest,
    AddRequest,
    EngineOutputs,
    EngineStats,
    Heartbeat,
    RequestError,
)
from shared.sampling_params import SamplingParams

log = logging.getLogger("pagoda.frontend.engine")
HEARTBEAT_S = 1.0
SCHEDULER_SILENCE_S = 10.0  # ten missed heartbeat answers: the scheduler is gone
ENGINE_STARTUP_S = ProcessSettings.startup_timeout_s  # the wait for its first answer


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
        silence_s: float = SCHEDULER_SILENCE_S,
        startup_s: float = ENGINE_STARTUP_S,
        curve: CurveKeys | None = None,
        fault: str | None = None,
    ) -> None:
        self.frontend_id = frontend_id
        self.stats = stats
        self.outputs = OutputProcessor()
        self._heartbeat_s = heartbeat_s
        self._silence_s = silence_s
        self._startup_s = startup_s
        self._last_heard = time.monotonic()  # the scheduler's last message (or our start)
        self._heard = False  # whether the scheduler ever answered: else it is starting
        self._heartbeat_task: asyncio.Task[None] | None = None
        opts: dict[str, Any] = {} if hwm is None else {"sndhwm": hwm, "rcvhwm": hwm}
        self._sock = make_socket(ctx, zmq.DEALER, address, identity=frontend_id.encode(),
                                 curve=curve, **opts)
        self._counter = counter
        self._ids = itertools.count()
        self._recv_task: asyncio.Task[None] | None = None
        # set when the receive loop died: the frontend cannot hear the engine any more
        self.failed = asyncio.Event()
        # tests only (shared/faults.py): exit on the N-th request, raise on the N-th outputs
        self._request_fault = FaultPoint("frontend", fault, actions=("exit",))
        self._message_fault = FaultPoint("frontend", fault, actions=("raise",))

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
        return len(self.outputs)

    # -- requests -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return str(next(self._ids))

    async def add(
        self, state: RequestState, prompt_token_ids: list[int], sampling_params: SamplingParams,
        *, priority: int = 0,
    ) -> None:
        """Send a request upstream; its outputs go to ``state`` (id from new_request_id)."""
        self._request_fault.step()
        # registered before the send, so no output can arrive for an id we do not hold
        self.outputs.add(state)
        msg = AddRequest(state.engine_request_id, prompt_token_ids, sampling_params, time.time(),
                         priority)
        try:
            await self._sock.send(encode(msg))
        except BaseException:
            self.outputs.end(state.engine_request_id, deliver=False)
            raise

    async def abort(self, request_ids: Sequence[str], index: int | None = None,
                    deliver: bool = True) -> None:
        """End requests (or one sample of each) here and at the scheduler.

        The ended samples' last outputs (finish_reason "abort") go to their sinks unless
        ``deliver`` is false (the client is gone). Idempotent: ids no longer held are
        left alone.
        """
        indices = None if index is None else [index]
        held = [r for r in request_ids if self.outputs.end(r, indices, deliver)]
        if held:
            await self._sock.send(encode(AbortRequest(held, index)))

    async def _heartbeat_loop(self) -> None:
        """Liveness both ways: the scheduler answers with EngineStats (our /health and
        /metrics) and drops the requests of a frontend that falls silent."""
        beat = encode(Heartbeat(self.frontend_id))
        while True:
            await self._check_silence()
            try:
                await self._sock.send(beat, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # the scheduler is not reading; health goes stale on its own
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM:
                    return
                log.warning("heartbeat send failed: %s", e)
            await asyncio.sleep(self._heartbeat_s)  # a period, not a synchronisation

    async def _check_silence(self) -> None:
        silent = time.monotonic() - self._last_heard
        if silent <= (self._silence_s if self._heard else self._startup_s) or not len(self.outputs):
            return
        why = (f"the scheduler has not answered for {silent:.0f} s" if self._heard else
               f"the engine did not start: no answer from the scheduler in {silent:.0f} s")
        failed = self.outputs.fail_all("engine_error", why)
        log.error("%s: failed the %d request(s) in flight", why, len(failed))
        if failed:  # aborts for a scheduler that may come back, so it frees their blocks
            with contextlib.suppress(zmq.ZMQError):
                await self._sock.send(encode(AbortRequest(failed)), flags=zmq.NOBLOCK)

    # -- receive --------------------------------------------------------------------------
    async def _receive_loop(self) -> None:
        """``_receive`` until cancelled; if it dies (a bug), every request in flight fails
        with engine_error, /health turns 503 and ``failed`` tells the process to exit."""
        try:
            await self._receive()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("the scheduler link's receive loop failed")
            why = f"the frontend's receive loop failed: {e}"[:500]
            if self.stats is not None:
                self.stats.mark_engine_dead(why)
            self.outputs.fail_all("engine_error", why)
            self.failed.set()

    async def _receive(self) -> None:
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
            self._last_heard = time.monotonic()
            self._heard = True
            msg = safe_decode(frames, SCHEDULER_TO_FRONTEND, self._counter)
            if isinstance(msg, EngineOutputs):  # heartbeat answers keep their own clock
                self._message_fault.step()
            if msg is not None:
                try:
                    await self._dispatch(msg)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug in one output must not end the receive loop
                    log.exception("processing a %s failed", type(msg).__name__)

    async def _dispatch(self, msg: EngineOutputs | RequestError | EngineStats) -> None:
        if isinstance(msg, EngineStats):
            if self.stats is not None:
                self.stats.update(msg)
        elif isinstance(msg, RequestError):
            if msg.code == "engine_error" and self.stats is not None:
                self.stats.mark_engine_dead(msg.message)
            if msg.code == "engine_error" and not msg.request_id:  # engine-wide: all fail
                self.outputs.fail_all(msg.code, msg.message)
            else:
                self.outputs.fail(msg.request_id, msg.code, msg.message)
        else:
            stopped = self.outputs.process(msg.outputs)
            if stopped:  # ended here by a stop string; the scheduler would keep decoding them
                by_index: dict[int, list[str]] = defaultdict(list)
                for request_id, index in stopped:
                    by_index[index].append(request_id)
                for index, ids in by_index.items():
                    await self._sock.send(encode(AbortRequest(ids, index)))
