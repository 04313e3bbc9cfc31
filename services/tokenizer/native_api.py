"""The frontend's native API: a ROUTER that ``pagoda.client`` connects DEALERs to.

Clients send ``GenerateRequest`` and ``AbortRequest`` (their own request ids, scoped
per client connection: the key of a request is (client identity, client request id)).
Per request, ``RequestRunner`` (shared with the HTTP API) validates and tokenizes it
(a bad request gets a typed ``RequestError`` and nothing reaches the scheduler) and
adds it upstream; then one task pumps its ``RunningRequest`` outputs back to the client
as ``GenerateOutput``s (stop strings and their upstream aborts happen in the runner).

Sends never wait on a client: they use NOBLOCK on a ROUTER_MANDATORY socket, so a
client that vanished (EHOSTUNREACH) or stopped reading until its pipe filled (EAGAIN)
fails the send at once; every request of that client is then aborted at the scheduler.
A vanished client is noticed at the first output sent to it after it left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from services.tokenizer.engine_client import EngineClient
from services.tokenizer.input_processor import InputProcessor, InvalidRequest
from services.tokenizer.request_runner import RequestFailed, RequestRunner, RunningRequest
from shared.codec import MalformedFrameCounter, encode, safe_decode
from shared.ipc import make_socket
from shared.protocol import (
    CLIENT_TO_FRONTEND,
    AbortRequest,
    GenerateOutput,
    GenerateRequest,
    RequestError,
)

log = logging.getLogger("pagoda.frontend.native")

ClientKey = tuple[bytes, str]  # (client identity, client request id)


@dataclass
class _Handle:
    identity: bytes
    run: RunningRequest
    task: asyncio.Task[None] | None = None


class NativeApi:
    """The native ZMQ API of one frontend process."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        engine: EngineClient,
        processor: InputProcessor,
        counter: MalformedFrameCounter,
        *,
        hwm: int | None = None,
        allow_wildcard: bool = False,
    ) -> None:
        opts: dict[str, Any] = {} if hwm is None else {"sndhwm": hwm, "rcvhwm": hwm}
        self.address = address
        self._sock = make_socket(ctx, zmq.ROUTER, address, allow_wildcard=allow_wildcard, **opts)
        self._engine = engine
        self._runner = RequestRunner(engine, processor)
        self._counter = counter
        self._inflight: dict[ClientKey, _Handle] = {}
        self._accepting = True

    # -- lifecycle ----------------------------------------------------------------------
    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def stop_accepting(self) -> None:
        """New requests are answered ``overloaded`` from now on; in-flight ones go on."""
        self._accepting = False

    async def abort_all(self) -> None:
        """Shutdown: end every in-flight request (clients get finish_reason "abort")."""
        handles = list(self._inflight.items())
        finals = await self._runner.abort_many([h.run for _, h in handles])
        for (key, handle), outputs in zip(handles, finals):
            self._forget(key)
            for out in outputs:
                await self._send(handle.identity, out, drop_on_failure=False)

    async def close(self) -> None:
        for key in list(self._inflight):
            self._forget(key)
        self._sock.close()  # linger flushes the last outputs
        if self.address.startswith("ipc://"):  # libzmq 4.3 leaves the socket file behind
            with contextlib.suppress(OSError):
                os.unlink(self.address[len("ipc://"):])

    async def serve(self) -> None:
        """The receive loop; runs until cancelled and never raises otherwise."""
        while True:
            try:
                frames = await self._sock.recv_multipart(copy=False)
            except zmq.ZMQError as e:
                if e.errno == zmq.ETERM:
                    return
                log.warning("native API receive failed: %s", e)
                continue
            msg = safe_decode(frames, CLIENT_TO_FRONTEND, self._counter, num_frames=2)
            if msg is None:
                continue
            identity = frames[0].bytes
            try:
                if isinstance(msg, GenerateRequest):
                    await self._on_generate(identity, msg)
                else:
                    await self._on_abort(identity, msg)
            except asyncio.CancelledError:
                raise
            except Exception:  # one request's failure must not end the loop
                log.exception("native API: handling a %s failed", type(msg).__name__)

    # -- client messages ----------------------------------------------------------------
    async def _on_generate(self, identity: bytes, req: GenerateRequest) -> None:
        key = (identity, req.request_id)
        if not self._accepting:
            await self._reply_error(identity, req.request_id, "overloaded",
                                    "this frontend is shutting down; retry on another")
            return
        if key in self._inflight:
            await self._reply_error(identity, req.request_id, "invalid_request",
                                    f"request_id {req.request_id!r} is already in flight")
            return
        try:
            processed = self._runner.prepare(req)
        except InvalidRequest as e:
            await self._reply_error(identity, req.request_id, e.code, str(e))
            return
        run = await self._runner.start(processed, req.request_id, req.stream)
        handle = _Handle(identity, run)
        self._inflight[key] = handle
        handle.task = asyncio.get_running_loop().create_task(self._pump(key, handle))

    async def _on_abort(self, identity: bytes, msg: AbortRequest) -> None:
        for client_id in msg.request_ids:
            handle = self._inflight.get((identity, client_id))
            if handle is None:
                continue  # finished already, or never ours: aborting is idempotent
            run = handle.run
            if msg.index is not None and not 0 <= msg.index < len(run.state.samples):
                continue
            for out in await run.abort(None if msg.index is None else [msg.index]):
                if not await self._send(identity, out):
                    return
            if run.finished:
                self._forget((identity, client_id))

    # -- the per-request pump -------------------------------------------------------------
    async def _pump(self, key: ClientKey, handle: _Handle) -> None:
        run, identity = handle.run, handle.identity
        client_id = run.state.client_request_id
        try:
            async for out in run.outputs():
                if not await self._send(identity, out):
                    return  # the client is gone; _drop_client aborted everything of it
            self._forget(key)
        except RequestFailed as e:
            self._forget(key)
            await self._reply_error(identity, client_id, e.code, e.message)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("request %s failed in the frontend", run.request_id)
            self._forget(key)
            await self._engine.abort([run.request_id])
            await self._reply_error(identity, client_id, "engine_error",
                                    "the frontend failed while processing this request")

    # -- sending ------------------------------------------------------------------------
    async def _reply_error(self, identity: bytes, request_id: str, code: str, message: str) -> None:
        await self._send(identity, RequestError(request_id, code, message))

    async def _send(
        self, identity: bytes, msg: GenerateOutput | RequestError, drop_on_failure: bool = True
    ) -> bool:
        """Send without waiting; on failure drop the client (abort its requests)."""
        try:
            await self._sock.send_multipart([identity, encode(msg)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                why = "disconnected"
            elif e.errno == zmq.EAGAIN:
                why = "is too slow (its pipe is full)"
            else:
                why = f"send failed ({e})"
        if drop_on_failure:
            await self._drop_client(identity, why)
        return False

    async def _drop_client(self, identity: bytes, why: str) -> None:
        keys = [k for k in self._inflight if k[0] == identity]
        engine_ids = [self._inflight[k].run.request_id for k in keys]
        for k in keys:
            self._forget(k)
        if engine_ids:
            await self._engine.abort(engine_ids)
        if keys:
            log.warning("client %s %s: aborted its %d request(s)", identity.hex()[:16], why,
                        len(keys))

    def _forget(self, key: ClientKey) -> None:
        """Stop tracking a request; cancel its pump unless the pump is the caller."""
        handle = self._inflight.pop(key, None)
        if handle is None or handle.task is None:
            return
        if handle.task is not asyncio.current_task() and not handle.task.done():
            handle.task.cancel()

