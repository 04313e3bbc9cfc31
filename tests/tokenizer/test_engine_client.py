"""EngineClient's receive side: what a scheduler message does to health and to sinks."""

from __future__ import annotations

import asyncio

import zmq.asyncio

from services.tokenizer.engine_client import EngineClient
from services.tokenizer.engine_stats import EngineStatsView
from services.tokenizer.frontend_core import ClientRequest
from services.tokenizer.output_processor import OutputItem, RequestFailed, RequestState
from shared.codec import MalformedFrameCounter
from shared.protocol import EngineStats, Histogram, RequestError
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


def test_a_silent_scheduler_fails_the_requests_in_flight() -> None:
    """No answer to the heartbeats for ``silence_s`` with a request in flight: the request
    fails with engine_error at once, not whenever (or never) its outputs would come."""

    async def run() -> tuple[list[OutputItem], float]:
        ctx = zmq.asyncio.Context()
        client = EngineClient(ctx, "ipc:///tmp/pagoda-test-no-scheduler.sock", "fe",
                              MalformedFrameCounter(), heartbeat_s=0.05, silence_s=0.3)
        items: list[OutputItem] = []
        done = asyncio.Event()

        def put(item: OutputItem) -> None:
            items.append(item)
            done.set()

        client.outputs.add(RequestState("7", 0, SamplingParams(), 3, None, True,
                                        ClientRequest(1, put)))
        start = asyncio.get_running_loop().time()
        client.start()
        try:
            await asyncio.wait_for(done.wait(), timeout=10)
        finally:
            await client.close()
            ctx.term()
        return items, asyncio.get_running_loop().time() - start

    items, waited = asyncio.run(run())
    assert len(items) == 1 and isinstance(items[0], RequestFailed)
    assert items[0].code == "engine_error" and "has not answered" in items[0].message
    assert 0.3 <= waited < 5

