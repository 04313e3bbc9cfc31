"""EngineClient's receive side: what a scheduler message does to health and to sinks."""

from __future__ import annotations

import asyncio

import zmq.asyncio

from services.tokenizer.engine_client import EngineClient
from services.tokenizer.engine_stats import EngineStatsView
from services.tokenizer.frontend_core import ClientRequest
from services.tokenizer.output_processor import OutputItem, RequestFailed, RequestState
from shared.codec import MalformedFrameCounter, encode, safe_decode
from shared.protocol import (
    FRONTEND_TO_SCHEDULER,
    AddRequest,
    EngineOutput,
    EngineOutputs,
    EngineStats,
    Heartbeat,
    Histogram,
    RequestError,
)
from shared.sampling_params import SamplingParams


def stats_message() -> EngineStats:
    empty = Histogram([], [0], 0.0, 0)
    return EngineStats(0, 0, 0.0, 8, 0, 0, 0, 0, 0, 0, 0, 0, empty, empty, empty, empty, 0)


async def dispatch_all(messages: list[object]) -> tuple[EngineStatsView, list[OutputItem]]:
    ctx = zmq.asyncio.Context()
    counter = MalformedFrameCounter()
    view = EngineStatsView("fe", counter)
    # a DEALER connects lazily: no scheduler needs to listen for this test
    client = EngineClient(ctx, "ipc:///tmp/pagoda-test-no-scheduler.sock", "fe", counter, stats=view)
    items: list[OutputItem] = []
    client.outputs.add(RequestState("7", 0, SamplingParams(), 3, None, True,
                                    ClientRequest(1, items.append)))
    try:
        for msg in messages:
            await client._dispatch(msg)  # type: ignore[arg-type]
    finally:
        await client.close()
        ctx.term()
    return view, items


def test_an_engine_wide_error_turns_health_503_and_fails_what_is_in_flight() -> None:
    view, items = asyncio.run(dispatch_all([
        stats_message(), RequestError("", "engine_error", "engine error: a worker disconnected")]))
    healthy, reason = view.health()
    assert not healthy and "a worker disconnected" in reason
    # the engine is dead: every request in flight here fails, named or not (the scheduler
    # names each first, but its own state may be what broke)
    assert len(items) == 1 and isinstance(items[0], RequestFailed)
    assert items[0].code == "engine_error"


def test_a_request_error_fails_only_its_sink() -> None:
    view, items = asyncio.run(dispatch_all([stats_message(),
                                            RequestError("7", "overloaded", "queue full")]))
    assert view.health() == (True, "ok")
    assert len(items) == 1 and isinstance(items[0], RequestFailed) and items[0].code == "overloaded"


class _Sink:
    def __init__(self) -> None:
        self.items: list[OutputItem] = []
        self.done = asyncio.Event()

    def put(self, item: OutputItem) -> None:
        self.items.append(item)
        self.done.set()


def _hold(client: EngineClient, request_id: str = "7") -> _Sink:
    sink = _Sink()
    client.outputs.add(RequestState(request_id, 0, SamplingParams(), 3, None, True,
                                    ClientRequest(1, sink.put)))
    return sink


def assert_failed_in_time(items: list[OutputItem], waited: float, why: str,
                          after_s: float) -> None:
    """The one request in flight failed with engine_error saying ``why``, no sooner than
    ``after_s`` and long before the test's own timeout."""
    assert len(items) == 1 and isinstance(items[0], RequestFailed)
    assert items[0].code == "engine_error" and why in items[0].message
    assert after_s <= waited < 5


def test_an_engine_that_never_starts_fails_the_requests_after_the_startup_wait() -> None:
    """No answer to the heartbeats ever: the engine is starting, so a request in flight
    waits for ``startup_s`` (not the 10 s of silence that fail a running engine's), then
    fails with engine_error saying the engine did not start."""

    async def run() -> tuple[list[OutputItem], float]:
        ctx = zmq.asyncio.Context()
        client = EngineClient(ctx, "ipc:///tmp/pagoda-test-no-scheduler.sock", "fe",
                              MalformedFrameCounter(), heartbeat_s=0.05, silence_s=0.05,
                              startup_s=0.6)
        sink = _hold(client)
        start = asyncio.get_running_loop().time()
        client.start()
        try:
            await asyncio.wait_for(sink.done.wait(), timeout=10)
        finally:
            await client.close()
            ctx.term()
        return sink.items, asyncio.get_running_loop().time() - start

    assert_failed_in_time(*asyncio.run(run()), "did not start", after_s=0.6)


def _scheduler(ctx: zmq.asyncio.Context, address: str) -> zmq.asyncio.Socket:
    """A stand-in for the scheduler's ROUTER, bound (late) at ``address``."""
    sock = ctx.socket(zmq.ROUTER)
    sock.linger = 0
    sock.bind(address)
    return sock


async def _next(sock: zmq.asyncio.Socket, kind: type) -> tuple[bytes, object]:
    while True:  # heartbeats queue up beside the message a test waits for
        identity, *frames = await asyncio.wait_for(sock.recv_multipart(), timeout=10)
        msg = safe_decode(frames, FRONTEND_TO_SCHEDULER, MalformedFrameCounter())
        if isinstance(msg, kind):
            return identity, msg


def test_a_request_sent_before_the_scheduler_binds_is_served_once_it_does(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A request added while the engine is still starting is not lost: ZMQ holds it in the
    DEALER's queue and delivers it when the scheduler binds, and its outputs come back."""
    address = f"ipc://{tmp_path}/scheduler.sock"

    async def run() -> list[OutputItem]:
        ctx = zmq.asyncio.Context()
        client = EngineClient(ctx, address, "fe", MalformedFrameCounter(), heartbeat_s=0.05,
                              silence_s=0.2, startup_s=30)
        sink = _Sink()
        state = RequestState(client.new_request_id(), 0, SamplingParams(max_tokens=2), 3,
                             None, True, ClientRequest(1, sink.put))
        client.start()
        await client.add(state, [1, 2, 3], SamplingParams(max_tokens=2))
        await asyncio.sleep(0.5)  # the scheduler binds well past silence_s: still starting
        scheduler = _scheduler(ctx, address)
        try:
            identity, add = await _next(scheduler, AddRequest)
            assert isinstance(add, AddRequest) and add.prompt_token_ids == [1, 2, 3]
            await scheduler.send_multipart([identity, encode(EngineOutputs([EngineOutput(
                add.request_id, 0, [5, 6], finish_reason="length", num_prompt_tokens=3)]))])
            await asyncio.wait_for(sink.done.wait(), timeout=10)
        finally:
            scheduler.close()
            await client.close()
            ctx.term()
        return sink.items

    items = asyncio.run(run())
    assert len(items) == 1 and not isinstance(items[0], RequestFailed)
    assert items[0].token_ids == [5, 6] and items[0].finish_reason == "length"


def test_a_scheduler_that_answered_then_fell_silent_fails_the_requests_in_flight(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Once the scheduler has answered, ``silence_s`` without a word with a request in
    flight fails the request with engine_error at once, not whenever (or never) its
    outputs would come."""
    address = f"ipc://{tmp_path}/scheduler.sock"

    async def run() -> tuple[list[OutputItem], float]:
        ctx = zmq.asyncio.Context()
        scheduler = _scheduler(ctx, address)
        client = EngineClient(ctx, address, "fe", MalformedFrameCounter(), heartbeat_s=0.05,
                              silence_s=0.3, startup_s=30)
        sink = _hold(client)
        client.start()
        try:
            identity, _ = await _next(scheduler, Heartbeat)
            await scheduler.send_multipart([identity, encode(stats_message())])
            start = asyncio.get_running_loop().time()  # heard: then nothing more
            await asyncio.wait_for(sink.done.wait(), timeout=10)
        finally:
            scheduler.close()
            await client.close()
            ctx.term()
        return sink.items, asyncio.get_running_loop().time() - start

    assert_failed_in_time(*asyncio.run(run()), "has not answered", after_s=0.3)
