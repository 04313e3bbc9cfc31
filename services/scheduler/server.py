"""The scheduler process's IO and step loop around the scheduler core.

Sockets (addresses in ``shared.config.Endpoints``):
- ``frontends``: ROUTER (binds); each frontend's DEALER identity owns its requests.
  In: AddRequest, AbortRequest. Out: RequestOutputs (one per step per frontend),
  RequestError.
- ``steps``: XPUB (binds); every worker rank's SUB gets each StepBatch. Subscription
  events tell us when a worker connects or goes away.
- ``results``: PULL (binds); WorkerReady from every rank at start-up, then StepResult
  from rank 0.

Loop: take every pending frontend message (blocking only when idle), schedule one
step, publish it, wait for its result (watching for a vanished worker), update, and
send each frontend its outputs without blocking: a frontend whose pipe is gone or
full is treated as vanished and its requests are aborted. A dead worker fails every
request with ``engine_error`` and ends the process (exit 1), so the launcher or the
container runtime restarts the stack instead of leaving it hung.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import time
from typing import Any

import zmq

from services.scheduler.metrics import EngineMetrics
from services.scheduler.request import seq_id_of
from services.scheduler.request_router import RequestRouter, internal_id
from services.scheduler.scheduler import RequestRejected, Scheduler, SchedulerConfig
from shared.codec import MalformedFrameCounter, encode, safe_decode
from shared.config import PagodaConfig
from shared.ipc import make_socket, wait_for_subscribers
from shared.protocol import (
    AbortRequest,
    AddRequest,
    EngineStats,
    Heartbeat,
    RequestError,
    RequestOutput,
    RequestOutputs,
    StepBatch,
    StepResult,
    WorkerReady,
)

log = logging.getLogger("pagoda.scheduler")
IDLE_POLL_MS = 200  # the idle loop's wake-up to look at the stop flag
STEP_TIMEOUT_S = 600.0  # no result for this long: the worker is wedged
FRONTEND_SILENCE_S = 15.0  # heartbeats are ~1 s apart; a step may hold the loop for seconds


class EngineDeadError(RuntimeError):
    """A worker vanished or stopped answering; the stack cannot go on."""


class SchedulerServer:
    def __init__(self, config: PagodaConfig, stop: threading.Event | None = None) -> None:
        self.config = config
        self.stop = stop or threading.Event()
        self.counter = MalformedFrameCounter(log)
        self.router = RequestRouter()
        self.metrics = EngineMetrics()
        self.ctx: zmq.Context[Any] = zmq.Context()
        ep, proc = config.endpoints, config.process
        opts = dict(sndhwm=proc.socket_hwm, rcvhwm=proc.socket_hwm, max_msg_size=proc.max_frame_bytes,
                    allow_wildcard=proc.allow_wildcard_bind)
        self.frontends = make_socket(self.ctx, zmq.ROUTER, ep.scheduler_frontend, **opts)  # type: ignore[arg-type]
        self.steps = make_socket(self.ctx, zmq.XPUB, ep.scheduler_step, **opts)  # type: ignore[arg-type]
        self.results = make_socket(self.ctx, zmq.PULL, ep.scheduler_result, **opts)  # type: ignore[arg-type]
        self.scheduler: Scheduler | None = None
        self.num_workers = config.engine.tensor_parallel_size
        self._subscribers = 0  # live step subscriptions (one per worker rank)
        self._heartbeats: dict[bytes, float] = {}  # frontend identity -> last heartbeat (monotonic)
        self._last_silence_check = 0.0

    # -- start-up --------------------------------------------------------------------
    def wait_for_workers(self, timeout_s: float) -> Scheduler:
        """The handshake: every rank's WorkerReady and step subscription; builds the core."""
        deadline = time.monotonic() + timeout_s
        ready: dict[int, WorkerReady] = {}
        while len(ready) < self.num_workers:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or self.stop.is_set():
                raise EngineDeadError(f"{len(ready)} of {self.num_workers} workers reported ready")
            if self.results.poll(min(remaining_ms, IDLE_POLL_MS), zmq.POLLIN):
                msg = safe_decode(self.results.recv_multipart(copy=False), "scheduler_result",
                                  (WorkerReady,), self.counter)
                if msg is not None:
                    ready[msg.rank] = msg
        subscribed = wait_for_subscribers(self.steps, self.num_workers, max(0.1, deadline - time.monotonic()))
        self._subscribers = subscribed
        if subscribed < self.num_workers:
            raise EngineDeadError(f"{subscribed} of {self.num_workers} workers subscribed to steps")
        engine = self.config.engine
        first = ready[min(ready)]
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=min(r.num_kv_blocks for r in ready.values()),
            block_size=engine.block_size,
            max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_model_len=min(r.max_model_len for r in ready.values()),
            vocab_size=first.vocab_size,
            enable_prefix_caching=engine.enable_prefix_caching,
            eos_token_ids=tuple(first.eos_token_ids),
            # tests run the stack with PAGODA_TESTING=1: a broken invariant is fatal there
            strict_invariants=os.environ.get("PAGODA_TESTING") == "1",
        ))
        # the block pool and request table are long-lived: keep them out of the
        # collector's generations so a full collection does not stall a step
        gc.collect()
        gc.freeze()
        return self.scheduler

    # -- the loop --------------------------------------------------------------------
    def run(self) -> int:
        sched = self.scheduler
        assert sched is not None, "wait_for_workers first"
        try:
            busy = False
            while not self.stop.is_set():
                self._take_frontend_messages(block=not sched.has_unfinished_requests())
                if sched.has_unfinished_requests():
                    self._step(sched)
                    busy = True
                elif busy:  # just went idle: the step that emptied it ran the invariant check
                    busy = False
                    self._log_idle(sched)
            self._abort_everything("the scheduler is shutting down", code="shutting_down")
            return 0
        except EngineDeadError as e:
            log.error("engine dead: %s", e)
            self._abort_everything(f"engine error: {e}", code="engine_error")
            return 1

    def _log_idle(self, sched: Scheduler) -> None:
        st = sched.stats()
        log.info(
            "idle: running=%d waiting=%d kv_usage=%.4f prefix_hits=%d/%d preemptions=%d "
            "invariant_failures=%d malformed_frames=%d",
            st.running, st.waiting, st.kv_usage, st.prefix_cache_hits, st.prefix_cache_queries,
            st.num_preemptions, st.invariant_failures, self.counter.count(),
        )

    def _step(self, sched: Scheduler) -> None:
        batch = sched.schedule()
        self.metrics.on_step(batch, time.time())
        self._publish(batch)
        result = self._wait_result(batch.step_id)
        outputs = sched.update(batch, result)
        self._send_outputs(outputs)

    def _publish(self, batch: StepBatch) -> None:
        try:
            self.steps.send(encode(batch), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError("a worker stopped taking steps (its pipe is full)") from None

    def _wait_result(self, step_id: int) -> StepResult:
        deadline = time.monotonic() + STEP_TIMEOUT_S
        poller = zmq.Poller()
        poller.register(self.results, zmq.POLLIN)
        poller.register(self.steps, zmq.POLLIN)
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0:
                raise EngineDeadError(f"no result for step {step_id} within {STEP_TIMEOUT_S:.0f}s")
            events = dict(poller.poll(remaining_ms))
            if self.steps in events:
                self._watch_subscriptions()
            if self.results in events:
                msg = safe_decode(self.results.recv_multipart(copy=False), "scheduler_result",
                                  (StepResult,), self.counter)
                if msg is not None and msg.step_id == step_id:
                    return msg
                if msg is not None:  # a late duplicate of an older step
                    self.counter.record("scheduler_result", "stale_step", b"", f"step {msg.step_id}")

    def _watch_subscriptions(self) -> None:
        # a worker's SUB subscribes to everything: exactly b"\x01" when it connects and
        # b"\x00" when it goes away. Anything else is some other peer's noise (counted as
        # a subscription to another topic, or ignored), and must not stop the engine.
        while self.steps.poll(0, zmq.POLLIN):
            event = self.steps.recv()
            if event == b"\x01":
                self._subscribers += 1
            elif event == b"\x00":
                self._subscribers -= 1
                if self._subscribers < self.num_workers:
                    raise EngineDeadError("a worker disconnected")
            else:
                self.counter.record("scheduler_step", "not_a_subscription", event[:16], "ignored")

    # -- frontends -------------------------------------------------------------------
    def _take_frontend_messages(self, block: bool) -> None:
        timeout = IDLE_POLL_MS if block else 0
        while self.frontends.poll(timeout, zmq.POLLIN):
            timeout = 0
            frames = self.frontends.recv_multipart(copy=False)
            msg = safe_decode(frames, "scheduler_frontend", (AddRequest, AbortRequest, Heartbeat),
                              self.counter, num_frames=2)
            if msg is None:
                continue
            identity = frames[0].bytes
            if isinstance(msg, AddRequest):
                self._add(identity, msg)
            elif isinstance(msg, AbortRequest):
                self._abort(identity, msg)
            else:
                self._heartbeats[identity] = time.monotonic()
                self._send(identity, self.engine_stats())
        self._drop_silent_frontends()
        if block and self.steps.poll(0, zmq.POLLIN):
            self._watch_subscriptions()

    def _drop_silent_frontends(self) -> None:
        """A frontend that heartbeats and then falls silent is gone (killed, partitioned):
        its requests are aborted even if none of them has produced output yet."""
        now = time.monotonic()
        if now - self._last_silence_check < 1.0:
            return
        self._last_silence_check = now
        for identity, last in list(self._heartbeats.items()):
            if now - last > FRONTEND_SILENCE_S:
                del self._heartbeats[identity]
                if self.router.requests_of(identity):
                    log.warning("frontend %s silent for %.0fs: aborting its requests", identity.hex(),
                                now - last)
                    self._drop_frontend(identity)

    def _add(self, identity: bytes, msg: AddRequest) -> None:
        sched = self.scheduler
        assert sched is not None
        if self.router.owns(identity, msg.request_id):
            self._send_error(identity, msg.request_id, "duplicate_id",
                             f"request id {msg.request_id!r} is already in use")
            return
        # the bound is on sequences that must wait: those the next step can admit into
        # free running slots are not queued (several requests often arrive between steps)
        free_slots = max(0, self.config.engine.max_num_seqs - len(sched.running))
        queued = max(0, len(sched.waiting) + msg.sampling_params.n - free_slots)
        if queued > self.config.engine.max_queued_requests:
            self._send_error(identity, msg.request_id, "overloaded",
                             f"{len(sched.waiting)} sequences are waiting and "
                             f"{len(sched.running)} running; retry later")
            return
        iid = self.router.add(identity, msg.request_id)
        try:
            sched.add_request(iid, msg.prompt_token_ids, msg.sampling_params, msg.priority)
        except RequestRejected as e:
            self.router.forget(iid)
            self._send_error(identity, msg.request_id, e.code, str(e))
            return
        seq_ids = [seq_id_of(iid, i) for i in range(msg.sampling_params.n)]
        self.metrics.on_add(iid, seq_ids, msg.arrival_time, len(msg.prompt_token_ids))

    def engine_stats(self) -> EngineStats:
        sched = self.scheduler
        assert sched is not None
        return self.metrics.snapshot(sched.stats(), sched.config.num_blocks, self.counter)

    def _abort(self, identity: bytes, msg: AbortRequest) -> None:
        sched = self.scheduler
        assert sched is not None
        # only the owner may abort: ids are looked up in the sender's scope
        own = [internal_id(identity, rid) for rid in msg.request_ids if self.router.owns(identity, rid)]
        self._send_outputs(sched.abort_request(own, msg.index))

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        sched = self.scheduler
        assert sched is not None
        self.metrics.on_outputs(outputs, time.time())
        finished = {o.request_id for o in outputs if o.finished and o.request_id not in sched.requests}
        for identity, outs in self.router.route(outputs, finished).items():
            self._send(identity, RequestOutputs(outs))

    def _send_error(self, identity: bytes, request_id: str, code: str, message: str) -> None:
        self._send(identity, RequestError(request_id, code, message))

    def _send(self, identity: bytes, msg: RequestOutputs | RequestError | EngineStats) -> None:
        try:
            self.frontends.send_multipart([identity, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH: gone; EAGAIN: not reading
            log.warning("frontend %s unreachable (%s): aborting its requests", identity.hex(), e.strerror)
            self._drop_frontend(identity)

    def _drop_frontend(self, identity: bytes) -> None:
        sched = self.scheduler
        assert sched is not None
        iids = self.router.requests_of(identity)
        self.metrics.on_outputs(sched.abort_request(iids), time.time())
        for iid in iids:
            self.router.forget(iid)

    def _abort_everything(self, message: str, code: str) -> None:
        sched = self.scheduler
        if sched is None:
            return
        for iid in self.router.all_requests():
            owner = self.router.owner(iid)
            self.metrics.on_outputs(sched.abort_request([iid]), time.time())
            self.router.forget(iid)
            if owner is not None:
                try:
                    self.frontends.send_multipart([owner[0], encode(RequestError(owner[1], code, message))],
                                                  flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass

    def close(self) -> None:
        for sock in (self.frontends, self.steps, self.results):
            sock.close()
        self.ctx.term()
        # libzmq leaves ipc:// socket files behind; the binder removes its own
        for address in (self.config.endpoints.scheduler_frontend, self.config.endpoints.scheduler_step,
                        self.config.endpoints.scheduler_result):
            if address.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(address[len("ipc://"):])
