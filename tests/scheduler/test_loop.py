"""The scheduler loop over real sockets, with a worker whose steps take seconds.

A stand-in worker thread speaks the worker link (WorkerReady, then StepBatch ->
StepResult through ``FakeWorker``) and holds every step until the test releases it
or ``hold_s`` passes; the test plays a frontend on a DEALER. What is checked: the
loop answers heartbeats and takes aborts while a step runs, applies a mid-step abort
at that step's update (no token of it is reported, its blocks are freed), and the
watchdog fails every request with ``engine_error`` and exits 1 when a step never ends.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq

from services.scheduler.handshake import SchedulerSockets, wait_for_workers
from services.scheduler.loop import SchedulerLoop
from services.worker.main import heartbeat
from shared.codec import MalformedFrameCounter, encode, safe_decode
from shared.config import Endpoints, load_config
from shared.ipc import make_socket, private_run_dir
from shared.protocol import (
    SCHEDULER_TO_FRONTEND,
    SCHEDULER_TO_WORKER,
    AbortRequest,
    AddRequest,
    EngineOutputs,
    EngineStats,
    Heartbeat,
    RequestError,
    StepBatch,
    WorkerReady,
)
from shared.sampling_params import SamplingParams
from support.fake_worker import FakeWorker

BLOCK_SIZE = 4
VOCAB = 1000


@dataclass
class HeldWorker:
    """Rank 0 of a worker group whose every step lasts ``hold_s`` unless released."""

    endpoints: Endpoints
    hold_s: float
    release: threading.Event = field(default_factory=threading.Event)
    steps: list[StepBatch] = field(default_factory=list)
    step_started: threading.Condition = field(default_factory=threading.Condition)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        ctx: zmq.Context[Any] = zmq.Context()
        sub = make_socket(ctx, zmq.SUB, self.endpoints.scheduler_step)
        push = make_socket(ctx, zmq.PUSH, self.endpoints.scheduler_result)
        push.send(encode(WorkerReady(0, 64, BLOCK_SIZE, 256, VOCAB, [])))
        beats = threading.Thread(target=heartbeat, daemon=True, args=(
            ctx, self.endpoints.scheduler_result, 0, self.stop, 0.1))
        beats.start()
        worker = FakeWorker(BLOCK_SIZE, VOCAB)
        counter = MalformedFrameCounter()
        try:
            while not self.stop.is_set():
                if not sub.poll(50, zmq.POLLIN):
                    continue
                batch = safe_decode(sub.recv_multipart(), SCHEDULER_TO_WORKER, counter)
                assert isinstance(batch, StepBatch)
                with self.step_started:
                    self.steps.append(batch)
                    self.step_started.notify_all()
                self.release.wait(self.hold_s)
                if self.stop.is_set():
                    break
                push.send(encode(worker.execute(batch)))
        finally:
            self.stop.set()
            beats.join()
            sub.close(linger=0)
            push.close(linger=0)
            ctx.term()

    def wait_for_steps(self, count: int, timeout_s: float = 10.0) -> StepBatch:
        with self.step_started:
            assert self.step_started.wait_for(lambda: len(self.steps) >= count, timeout_s)
            return self.steps[count - 1]


@dataclass
class Stack:
    loop: SchedulerLoop
    worker: HeldWorker
    frontend: zmq.Socket[Any]
    stop: threading.Event
    result: list[int]
    thread: threading.Thread
    sockets: SchedulerSockets

    def send(self, msg: object) -> None:
        self.frontend.send(encode(msg))

    def recv(self, timeout_s: float = 10.0) -> object:
        assert self.frontend.poll(int(timeout_s * 1000), zmq.POLLIN), "no message from the scheduler"
        msg = safe_decode(self.frontend.recv_multipart(), SCHEDULER_TO_FRONTEND,
                          MalformedFrameCounter())
        assert msg is not None
        return msg

    def recv_until(self, kind: type, timeout_s: float = 10.0) -> tuple[Any, list[object]]:
        """The first message of ``kind``, and every other message received before it."""
        others: list[object] = []
        deadline = time.monotonic() + timeout_s
        while True:
            msg = self.recv(max(0.01, deadline - time.monotonic()))
            if isinstance(msg, kind):
                return msg, others
            others.append(msg)


@pytest.fixture
def stack_factory() -> Iterator[Any]:
    started: list[Stack] = []
    ctx: zmq.Context[Any] = zmq.Context()
    dirs = contextlib.ExitStack()

    def start(hold_s: float, step_timeout_s: float = 60.0, async_scheduling: bool = True,
              run_loop: bool = True) -> Stack:
        """``run_loop=False``: the loop is built but its thread is not started; the test
        drives the loop itself or starts ``stack.thread`` when it has set the scene."""
        run_dir = dirs.enter_context(private_run_dir())
        endpoints = Endpoints.local(run_dir)
        config = load_config({"block_size": BLOCK_SIZE, "step_timeout_s": step_timeout_s,
                              "testing": True, "async_scheduling": async_scheduling},
                             env={}, default_endpoints=endpoints)
        stop = threading.Event()
        counter = MalformedFrameCounter()
        sockets = SchedulerSockets.bind(config)
        worker = HeldWorker(endpoints, hold_s)
        threading.Thread(target=worker.run, daemon=True).start()
        sched = wait_for_workers(sockets, config, counter, stop)
        loop = SchedulerLoop(sched, sockets, config, counter, stop)
        result: list[int] = []

        def run() -> None:
            try:
                result.append(loop.run())
            finally:
                sockets.close()

        thread = threading.Thread(target=run, daemon=True)
        if run_loop:
            thread.start()
        frontend = make_socket(ctx, zmq.DEALER, endpoints.scheduler_frontend, identity=b"fe-1")
        stack = Stack(loop, worker, frontend, stop, result, thread, sockets)
        started.append(stack)
        return stack

    yield start
    for stack in started:
        stack.stop.set()
        stack.worker.release.set()
        stack.worker.stop.set()
        if stack.thread.ident is None:  # never started: the test drove the loop itself
            stack.sockets.close()
        else:
            stack.thread.join(10)
        stack.frontend.close(linger=0)
    dirs.close()
    ctx.term()


def add(request_id: str, max_tokens: int = 50) -> AddRequest:
    return AddRequest(request_id, [5, 6, 7, 8, 9], SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                      time.time())


def test_heartbeats_are_answered_while_a_step_runs(stack_factory: Any) -> None:
    stack = stack_factory(hold_s=5.0)
    stack.send(add("r1"))
    stack.worker.wait_for_steps(1)  # the first step is now held for 5 s
    for _ in range(3):
        sent = time.monotonic()
        stack.send(Heartbeat("fe-1"))
        stats, _ = stack.recv_until(EngineStats, timeout_s=1.0)
        assert time.monotonic() - sent < 1.0
        assert stats.running == 1
    assert len(stack.worker.steps) == 1, "the step is still running"
    stack.worker.release.set()
    outputs, _ = stack.recv_until(EngineOutputs)
    assert outputs.outputs[0].request_id == "r1" and outputs.outputs[0].new_token_ids


def test_abort_mid_step_is_applied_at_that_steps_update(stack_factory: Any) -> None:
    stack = stack_factory(hold_s=5.0, async_scheduling=False)
    stack.send(add("r1"))
    stack.send(add("r2"))
    first = stack.worker.wait_for_steps(1)
    assert len(first.scheduled_request_ids) == 2
    stack.send(AbortRequest(["r1"]))
    stack.send(add("r3"))  # an add is taken in mid-step too
    # a heartbeat sent after them is answered only once they were taken (one pipe, in order)
    stack.send(Heartbeat("fe-1"))
    stats, before = stack.recv_until(EngineStats, timeout_s=1.0)
    assert before == [], "nothing is reported before the step ends"
    assert stats.running == 2 and stats.waiting == 1, "the abort waits for the update"
    stack.worker.release.set()
    outputs, _ = stack.recv_until(EngineOutputs)
    by_id = {o.request_id: o for o in outputs.outputs}
    assert by_id["r1"].finish_reason == "abort" and by_id["r1"].new_token_ids == []
    assert by_id["r2"].finish_reason is None and len(by_id["r2"].new_token_ids) == 1
    aborted_seq = first.scheduled_request_ids[0]
    second = stack.worker.wait_for_steps(2)
    assert aborted_seq in second.finished_request_ids
    assert aborted_seq not in second.scheduled_request_ids
    assert len(second.new_requests) == 1, "r3 joins the next step"
    stack.send(Heartbeat("fe-1"))
    stats, _ = stack.recv_until(EngineStats)
    assert stats.finished_abort == 1


def test_an_abort_between_steps_that_empties_the_scheduler_logs_idle(
        stack_factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    """With no step in flight an abort applies at once; when it takes the last request,
    the idle line (which operators and the live-stack tests read) is logged then, since
    no step's end will log it. Seen in CI: the last of two streams closed between steps."""
    stack = stack_factory(hold_s=5.0, run_loop=False)
    loop, sched = stack.loop, stack.loop.scheduler
    deadline = time.monotonic() + 10
    stack.send(add("r1"))
    while not sched.has_unfinished_requests() and time.monotonic() < deadline:
        loop._serve(50)  # the test drives the loop here
    assert sched.has_unfinished_requests()
    with caplog.at_level(logging.INFO, logger="pagoda.scheduler"):
        stack.send(AbortRequest(["r1"]))
        while sched.has_unfinished_requests() and time.monotonic() < deadline:
            loop._serve(50)
    assert not loop._in_flight, "no step ran"
    idle = [r.getMessage() for r in caplog.records if r.getMessage().startswith("idle:")]
    assert len(idle) == 1 and "running=0 waiting=0 kv_usage=0.0000" in idle[0], idle
    outputs, _ = stack.recv_until(EngineOutputs)
    assert [(o.request_id, o.finish_reason) for o in outputs.outputs] == [("r1", "abort")]
    # an abort of nothing while idle logs nothing more
    with caplog.at_level(logging.INFO, logger="pagoda.scheduler"):
        stack.send(AbortRequest(["r1"]))
        stack.send(Heartbeat("fe-1"))  # answered once both were taken (one pipe, in order)
        while not stack.frontend.poll(0, zmq.POLLIN) and time.monotonic() < deadline:
            loop._serve(50)
        stack.recv_until(EngineStats)
    assert sum(r.getMessage().startswith("idle:") for r in caplog.records) == 1


def test_async_the_next_step_is_out_before_the_result_and_an_abort_waits(
        stack_factory: Any) -> None:
    stack = stack_factory(hold_s=5.0, run_loop=False)
    stack.send(add("r1"))
    stack.send(add("r2"))
    # both taken in before the loop runs: a running loop may schedule r1 alone (seen in CI)
    deadline = time.monotonic() + 10
    while stack.loop.engine_stats().waiting < 2 and time.monotonic() < deadline:
        stack.loop._serve(50)
    stack.thread.start()
    first = stack.worker.wait_for_steps(1)
    assert first.num_scheduled_tokens == [5, 5]  # both prompts whole
    stack.send(AbortRequest(["r1"]))
    stack.send(add("r3"))
    stack.send(Heartbeat("fe-1"))
    stats, before = stack.recv_until(EngineStats, timeout_s=1.0)
    assert before == [] and stats.running == 2 and stats.waiting == 1
    stack.worker.release.set()  # every step now runs at once
    # step 2 was published while step 1 ran: the decodes of the tokens step 1 samples
    second = stack.worker.wait_for_steps(2)
    assert second.scheduled_request_ids == first.scheduled_request_ids
    assert second.num_scheduled_tokens == [1, 1] and second.new_requests == []
    outputs, _ = stack.recv_until(EngineOutputs)
    by_id = {o.request_id: o for o in outputs.outputs}
    assert by_id["r1"].finish_reason == "abort" and by_id["r1"].new_token_ids == []
    assert by_id["r2"].finish_reason is None and len(by_id["r2"].new_token_ids) == 1
    aborted_seq = first.scheduled_request_ids[0]
    third = stack.worker.wait_for_steps(3)
    assert aborted_seq in third.finished_request_ids
    assert aborted_seq not in third.scheduled_request_ids
    assert len(third.new_requests) == 1, "r3 joins the step after the two out"
    # r1's token of step 2 (scheduled before the abort) is dropped, never reported
    tokens: dict[str, list[int]] = {}
    while True:
        outputs, _ = stack.recv_until(EngineOutputs)
        for o in outputs.outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert o.request_id != "r1", "an aborted request reported again"
        if len(tokens.get("r3", [])) >= 3:
            break
    stack.send(Heartbeat("fe-1"))
    stats, _ = stack.recv_until(EngineStats)
    assert stats.finished_abort == 1 and stats.running == 2


def test_watchdog_fails_requests_and_exits_1_when_a_step_never_ends(stack_factory: Any) -> None:
    stack = stack_factory(hold_s=3600.0, step_timeout_s=0.5)
    stack.send(Heartbeat("fe-1"))
    stack.recv_until(EngineStats)
    stack.send(add("r1"))
    stack.worker.wait_for_steps(1)
    started = time.monotonic()
    error, _ = stack.recv_until(RequestError, timeout_s=5.0)
    assert (error.request_id, error.code) == ("r1", "engine_error")
    assert "step-timeout" in error.message
    engine_wide, _ = stack.recv_until(RequestError, timeout_s=5.0)
    assert (engine_wide.request_id, engine_wide.code) == ("", "engine_error")
    stack.thread.join(5)
    assert stack.result == [1]
    assert time.monotonic() - started < 5.0



def test_a_silent_frontend_gets_an_error_for_each_dropped_request(stack_factory: Any) -> None:
    """A frontend that stops heartbeating (paused, partitioned) has its requests aborted,
    and is told so request by request: when it reads again, it fails them at once."""
    stack = stack_factory(hold_s=0.1)  # steps of 0.1 s: the requests outlive the silence
    stack.loop.frontend_silence_s = 0.5
    stack.send(Heartbeat("fe-1"))
    stack.recv_until(EngineStats)
    stack.send(add("r1", max_tokens=200))
    stack.send(add("r2", max_tokens=200))
    stack.recv_until(EngineOutputs)  # both run; now the frontend falls silent
    errors: dict[str, RequestError] = {}
    deadline = time.monotonic() + 10
    while len(errors) < 2 and time.monotonic() < deadline:
        msg = stack.recv()
        if isinstance(msg, RequestError):
            errors[msg.request_id] = msg
    assert set(errors) == {"r1", "r2"}
    assert all(e.code == "frontend_timeout" for e in errors.values())
    # back: nothing of its old requests is held once the step in flight has ended (the
    # aborts apply at its update)
    deadline = time.monotonic() + 5
    while True:
        stack.send(Heartbeat("fe-1"))
        stats, _ = stack.recv_until(EngineStats)
        if (stats.running, stats.waiting) == (0, 0) or time.monotonic() > deadline:
            break
    assert (stats.running, stats.waiting) == (0, 0)


def test_a_worker_is_known_by_its_heartbeats_not_by_subscriptions(stack_factory: Any) -> None:
    """A stray peer subscribes to the step stream too, then the real worker dies: the
    subscription count still looks whole, but the worker's heartbeats stop, so the engine
    is dead within the silence period (requests fail with engine_error, exit 1)."""
    stack = stack_factory(hold_s=0.0)
    stack.loop.worker_silence_s = 0.5
    ctx: zmq.Context[Any] = zmq.Context()
    stray = make_socket(ctx, zmq.SUB, stack.worker.endpoints.scheduler_step)
    stray.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        stack.send(Heartbeat("fe-1"))
        stack.recv_until(EngineStats)
        time.sleep(1.0)  # heartbeats keep a slow-stepping worker alive past the silence
        assert stack.thread.is_alive()
        stack.send(add("r1", max_tokens=1000))
        stack.worker.wait_for_steps(1)
        stack.worker.stop.set()  # the worker dies (its sockets close; the stray stays)
        killed = time.monotonic()
        error, _ = stack.recv_until(RequestError, timeout_s=10.0)
        assert error.code == "engine_error" and "no heartbeat" in error.message, error
        stack.thread.join(5)
        assert stack.result == [1] and time.monotonic() - killed < 5
    finally:
        stray.close(linger=0)
        ctx.term()


def test_workers_leaving_during_the_schedulers_own_stop_is_not_an_engine_death() -> None:
    """A stack stopped as a whole (compose, the launcher) signals every process at once: a
    stopping scheduler that sees its worker leave must still end cleanly (exit 0)."""
    with private_run_dir() as run_dir:
        endpoints = Endpoints.local(run_dir)
        config = load_config({"block_size": BLOCK_SIZE, "testing": True}, env={},
                             default_endpoints=endpoints)
        stop, counter = threading.Event(), MalformedFrameCounter()
        sockets = SchedulerSockets.bind(config)
        worker = HeldWorker(endpoints, hold_s=5.0)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        try:
            loop = SchedulerLoop(wait_for_workers(sockets, config, counter, stop), sockets, config,
                                 counter, stop)
            stop.set()  # SIGTERM reached the scheduler ...
            worker.stop.set()  # ... and the worker, which leaves
            thread.join(5)
            assert sockets.steps.poll(5000, zmq.POLLIN), "no unsubscription arrived"
            loop._watch_subscriptions()  # raised EngineDeadError before: exit 1 on a clean stop
            assert loop.run() == 0
        finally:
            sockets.close()
