"""A stand-in for the scheduler process in frontend tests: the ROUTER end of the link.

It runs in a thread of the test process, binds the scheduler's frontend ROUTER, records
every ``AddRequest`` / ``AbortRequest`` a frontend sends (with the frontend's identity),
and answers with fabricated token outputs instead of running a model: each request
follows a ``Script`` (the token ids each sample emits, how many per step, how it ends),
chosen per request by ``script_for``. Steps run every ``step_interval_s`` while work
exists, so outputs arrive in several batches, like the real step loop.

Tests wait on what it recorded with ``wait_for(predicate, timeout)``, which polls
under a condition variable with a deadline (no sleeps).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from shared.codec import MalformedFrameCounter, encode, safe_decode
from shared.ipc import make_socket
from shared.protocol import (
    FRONTEND_TO_SCHEDULER,
    AbortRequest,
    AddRequest,
    EngineOutput,
    EngineOutputs,
    Heartbeat,
    RequestError,
    TokenLogprobs,
)


@dataclass
class Script:
    samples: list[list[int]]  # sample i emits samples[i % len(samples)]
    tokens_per_step: int = 1
    finish_reason: str = "length"
    stop_reason: int | None = None
    forever: bool = False  # cycle the tokens and never finish (until aborted)
    num_cached_tokens: int = 0
    error: tuple[str, str] | None = None  # answer RequestError(code, message) instead


@dataclass
class _Running:
    identity: bytes
    add: AddRequest
    script: Script
    index: int
    pos: int = 0


@dataclass
class FakeScheduler:
    address: str
    script_for: Callable[[AddRequest], Script] = lambda add: Script([[65, 66, 67]])
    step_interval_s: float = 0.002
    send_abort_outputs: bool = True  # answer an abort with finish_reason "abort" outputs
    adds: list[tuple[bytes, AddRequest]] = field(default_factory=list)
    aborts: list[tuple[bytes, AbortRequest]] = field(default_factory=list)
    counter: MalformedFrameCounter = field(default_factory=MalformedFrameCounter)

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._running: dict[tuple[bytes, str, int], _Running] = {}
        self._pending: list[tuple[bytes, EngineOutput]] = []
        self._thread = threading.Thread(target=self._loop, name="fake-scheduler", daemon=True)
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._sock = make_socket(self._ctx, zmq.ROUTER, self.address)

    # -- test side ------------------------------------------------------------------------
    def start(self) -> FakeScheduler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sock.close(linger=0)
        self._ctx.term()
        if self.address.startswith("ipc://"):  # libzmq 4.3 leaves the socket file behind
            Path(self.address[len("ipc://"):]).unlink(missing_ok=True)

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def add_for(self, prompt_token_ids: list[int]) -> AddRequest | None:
        with self._cond:
            for _, add in reversed(self.adds):
                if add.prompt_token_ids == prompt_token_ids:
                    return add
        return None

    def aborted(self, request_id: str, index: int | None = None) -> bool:
        with self._cond:
            return any(request_id in a.request_ids and (index is None or a.index == index)
                       for _, a in self.aborts)

    @property
    def num_running(self) -> int:
        with self._cond:
            return len(self._running)

    # -- the thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            timeout_ms = int(self.step_interval_s * 1000) if self._running else 50
            if self._sock.poll(max(timeout_ms, 1), zmq.POLLIN):
                while self._sock.poll(0, zmq.POLLIN):
                    self._receive(self._sock.recv_multipart())
            if self._running or self._pending:
                self._step()

    def _receive(self, frames: list[bytes]) -> None:
        msg = safe_decode(frames, FRONTEND_TO_SCHEDULER, self.counter, num_frames=2,
                          socket_name="fake_scheduler")
        if msg is None or isinstance(msg, Heartbeat):  # no liveness to track here
            return
        identity = frames[0]
        with self._cond:
            if isinstance(msg, AddRequest):
                self.adds.append((identity, msg))
                self._on_add(identity, msg)
            else:
                self.aborts.append((identity, msg))
                self._on_abort(identity, msg)
            self._cond.notify_all()

    def _on_add(self, identity: bytes, add: AddRequest) -> None:
        script = self.script_for(add)
        if script.error is not None:
            self._send(identity, RequestError(add.request_id, *script.error))
            return
        for i in range(add.sampling_params.n):
            self._running[(identity, add.request_id, i)] = _Running(identity, add, script, i)

    def _on_abort(self, identity: bytes, abort: AbortRequest) -> None:
        for key in list(self._running):
            ident, rid, index = key
            if ident == identity and rid in abort.request_ids and abort.index in (None, index):
                run = self._running.pop(key)
                if self.send_abort_outputs:
                    self._pending.append((identity, self._output(run, [], "abort")))

    def _step(self) -> None:
        by_frontend: dict[bytes, list[EngineOutput]] = {}
        with self._cond:
            for identity, out in self._pending:
                by_frontend.setdefault(identity, []).append(out)
            self._pending.clear()
            for key, run in list(self._running.items()):
                tokens = run.script.samples[run.index % len(run.script.samples)]
                if run.script.forever:
                    new = [tokens[(run.pos + k) % len(tokens)]
                           for k in range(run.script.tokens_per_step)]
                else:
                    new = tokens[run.pos: run.pos + run.script.tokens_per_step]
                run.pos += len(new)
                done = not run.script.forever and run.pos >= len(tokens)
                out = self._output(run, new, run.script.finish_reason if done else None)
                by_frontend.setdefault(run.identity, []).append(out)
                if done:
                    del self._running[key]
            self._cond.notify_all()
        for identity, outputs in by_frontend.items():
            self._send(identity, EngineOutputs(outputs))

    def _output(self, run: _Running, new: list[int], finish: str | None) -> EngineOutput:
        params = run.add.sampling_params
        logprobs = ([TokenLogprobs(-0.5, 1, [t], [-0.5]) for t in new]
                    if params.logprobs is not None else [])
        return EngineOutput(
            request_id=run.add.request_id, index=run.index, new_token_ids=new,
            new_logprobs=logprobs, finish_reason=finish,
            stop_reason=run.script.stop_reason if finish == "stop" else None,
            num_prompt_tokens=len(run.add.prompt_token_ids),
            num_cached_tokens=run.script.num_cached_tokens,
        )

    def _send(self, identity: bytes, msg: Any) -> None:
        try:
            self._sock.send_multipart([identity, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # the frontend vanished: drop its requests, as the real one does
            with self._cond:  # an RLock: _on_add already holds it
                for key in [k for k in self._running if k[0] == identity]:
                    del self._running[key]


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Poll ``predicate`` until it holds or the deadline passes (for conditions in other
    processes, which no condition variable can signal)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        threading.Event().wait(interval)
    return predicate()
