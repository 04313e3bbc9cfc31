"""The scheduler process's step loop: the core, its sockets, and a watchdog.

One thread polls three sockets (see ``services/scheduler/handshake.py``) and keeps at
most one step in flight on the workers, or two with async scheduling (the default):

    idle ──(work exists)──► schedule + publish ──► in flight ──(StepResult)──► update,
      ▲                                              │                        send outputs
      └──────────────────────────────────────────────┴────────────────────────────┘

With async scheduling, as soon as step N is published the loop schedules and publishes
step N+1 (``Scheduler.schedule`` counts what N will compute and sample), so the
workers find it queued when N ends and start it at once; N's result is applied while
N+1 runs, then N+2 is published. The workers run steps in the order published. When
nothing can run ahead (every sequence waits for N's token), the loop tries again only
once something changes: a result, a new request.

While a step is in flight the loop keeps serving the frontends: an ``AddRequest``
joins the waiting queue at once (the next ``schedule()`` sees it), a ``Heartbeat`` is
answered at once, and an ``AbortRequest`` (or a vanished frontend's requests) is held
and applied just before the next ``update``, so the aborted sequence reports no token
of that step and its blocks are handed out again only by a later ``schedule()``, whose
step the workers run after every step that used them.

KV cache events (``--kv-events-endpoint``): after every step's ``update`` the block
manager's recorded events go out as one vLLM-format batch (``kv_events.py``), NOBLOCK.

Forward-progress watchdog: a step with no result for ``step_timeout_s`` (counted from
when it was published, or from the previous step's result when it queued behind it) means a
wedged or dead worker. Then, as when a worker's step subscription goes away, every
request fails with ``engine_error``, every frontend that heartbeats is told (an
engine-wide ``RequestError`` with an empty request id, which turns its /health 503),
and ``run`` returns 1 so the process exits non-zero.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import zmq

from services.scheduler.handshake import POLL_MS, EngineDeadError, SchedulerSockets
from services.scheduler.metrics import EngineInfo
from services.scheduler.request_router import RequestRouter, internal_id
from services.scheduler.scheduler import RequestRejected, Scheduler
from shared.codec import MalformedFrameCounter, encode, safe_decode
from shared.config import PagodaConfig
from shared.faults import FaultPoint
from shared.protocol import (
    FRONTEND_TO_SCHEDULER,
    WORKER_TO_SCHEDULER,
    AbortRequest,
    AddRequest,
    EngineOutput,
    EngineOutputs,
    EngineStats,
    Heartbeat,
    RequestError,
    StepBatch,
    StepResult,
    WorkerHeartbeat,
)

log = logging.getLogger("pagoda.scheduler")
FRONTEND_SILENCE_S = 15.0  # heartbeats are ~1 s apart; this many seconds of silence = gone
WORKER_SILENCE_S = 10.0  # worker heartbeats are 1 s apart (services/worker/main.py)


@dataclass
class _InFlight:
    batch: StepBatch
    started: float  # time.monotonic(): published, or the step before it answered


class SchedulerLoop:
    def __init__(
        self, scheduler: Scheduler, sockets: SchedulerSockets, config: PagodaConfig,
        counter: MalformedFrameCounter, stop: threading.Event,
    ) -> None:
        self.scheduler = scheduler
        self.sockets = sockets
        self.config = config
        self.counter = counter
        self.stop = stop
        self.router = RequestRouter()
        self.kv_events = sockets.kv_events  # None: not published
        self.info = EngineInfo(model_name=served_model_name(config),
                               cache_dtype=config.engine.kv_cache_dtype)
        self.num_workers = config.engine.tensor_parallel_size
        self.step_timeout_s = config.process.step_timeout_s
        self.frontend_silence_s = FRONTEND_SILENCE_S  # tests shorten it
        self._fault = FaultPoint("scheduler", config.process.fault)
        self.worker_silence_s = WORKER_SILENCE_S
        # each rank's last WorkerHeartbeat; the handshake has just heard every one
        self._worker_beats = dict.fromkeys(range(self.num_workers), time.monotonic())
        self._subscribers = self.num_workers  # the handshake saw every rank subscribe
        self._heartbeats: dict[bytes, float] = {}  # frontend identity -> last heartbeat
        self._last_silence_check = 0.0
        # published steps without a result, oldest first: at most one, or two with
        # async scheduling (the next step queued behind the one running)
        self._in_flight: deque[_InFlight] = deque()
        self._max_in_flight = 2 if config.engine.async_scheduling else 1
        # nothing could be scheduled ahead: wait for a result or a new request first
        self._ahead_blocked = False
        # (internal ids, sample index) aborted while a step ran; applied before its update
        self._deferred_aborts: list[tuple[list[str], int | None]] = []
        self._poller = zmq.Poller()
        for sock in (sockets.frontends, sockets.steps, sockets.results):
            self._poller.register(sock, zmq.POLLIN)
        # a compiled structured-output grammar wakes the loop (its requests can run now)
        self._grammars = scheduler.structured_output
        if self._grammars is not None:
            self._poller.register(self._grammars.wakeup_fd, zmq.POLLIN)

    # -- the loop --------------------------------------------------------------------
    def run(self) -> int:
        """Until the stop flag: 0 after a clean stop, 1 when the engine died."""
        sched = self.scheduler
        try:
            while not self.stop.is_set():
                if not self._in_flight:
                    self._take_frontend_messages()  # what arrived since: into this step
                    if sched.has_unfinished_requests():
                        self._launch()
                if (0 < len(self._in_flight) < self._max_in_flight and not self._ahead_blocked
                        and sched.has_unfinished_requests() and not sched.waits_for_results()):
                    self._launch()
                self._serve(self._poll_timeout_ms())
                self._check_watchdog()
                self._check_workers()
                self._drop_silent_frontends()
            self._abort_everything("the scheduler is shutting down", code="shutting_down")
            return 0
        except EngineDeadError as e:
            log.error("engine dead: %s", e)
            self._fail_everything(f"engine error: {e}")
            return 1
        except Exception as e:  # a bug in the loop: as fast and loud as a dead engine
            log.exception("the scheduler loop failed")
            self._fail_everything(f"engine error: the scheduler loop failed: {e}"[:500])
            return 1

    def _fail_everything(self, message: str) -> None:
        """Every request fails with engine_error and every frontend hears the engine is
        dead; best effort, since the loop's own state may be what broke."""
        try:
            self._abort_everything(message, code="engine_error")
        except Exception:  # the frontends must still be told below
            log.exception("aborting the requests failed; the frontends fail them on notice")
        self._tell_frontends_engine_dead(message)

    def _poll_timeout_ms(self) -> int:
        if not self._in_flight:
            return POLL_MS
        left = self._in_flight[0].started + self.step_timeout_s - time.monotonic()
        return max(0, min(POLL_MS, int(left * 1000) + 1))

    def _serve(self, timeout_ms: int) -> None:
        events = dict(self._poller.poll(timeout_ms))
        s = self.sockets
        if s.steps in events:
            self._watch_subscriptions()
        if s.frontends in events:
            self._take_frontend_messages()
        if s.results in events:
            self._take_results()
        if self._grammars is not None and self._grammars.wakeup_fd in events:
            self._grammars.drain_wakeups()

    def _launch(self) -> None:
        batch = self.scheduler.schedule()
        self._send_request_errors()
        if not batch.scheduled_request_ids and not batch.finished_request_ids:
            if self._in_flight:  # nothing can run ahead of the step out: wait for it
                self._ahead_blocked = True
                return
            # nothing for the workers (only grammars compiling): the step ends here
            self._complete(batch, StepResult(step_id=batch.step_id))
            return
        self._fault.step()  # tests only (shared/faults.py): exits or raises, a step in flight
        try:
            self.sockets.steps.send(encode(batch), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError("a worker stopped taking steps (its pipe is full)") from None
        self._in_flight.append(_InFlight(batch, time.monotonic()))

    def _take_results(self) -> None:
        while self.sockets.results.poll(0, zmq.POLLIN):
            msg = safe_decode(self.sockets.results.recv_multipart(copy=False), WORKER_TO_SCHEDULER,
                              self.counter)
            if msg is None:
                continue
            if isinstance(msg, WorkerHeartbeat):
                if msg.rank in self._worker_beats:
                    self._worker_beats[msg.rank] = time.monotonic()
                continue
            flights = self._in_flight
            if (not isinstance(msg, StepResult) or not flights
                    or msg.step_id != flights[0].batch.step_id):
                what = f"step {msg.step_id}" if isinstance(msg, StepResult) else type(msg).__name__
                self.counter.record("scheduler_result", "stale_step", b"", what)
                continue
            flight = flights.popleft()
            if flights:  # the step queued behind it starts now: its clock too
                flights[0].started = time.monotonic()
            self._ahead_blocked = False
            self._complete(flight.batch, msg)

    def _complete(self, batch: StepBatch, result: StepResult) -> None:
        sched = self.scheduler
        outputs: list[EngineOutput] = []
        deferred, self._deferred_aborts = self._deferred_aborts, []
        for iids, index in deferred:
            outputs += sched.abort_request(iids, index)
        outputs += sched.update(batch, result)
        if self.kv_events is not None:  # this step's prefix-cache changes, one batch
            self.kv_events.publish(sched.block_manager.take_events())
        self._send_outputs(outputs)
        if not sched.has_unfinished_requests():
            self._log_idle()

    def _check_watchdog(self) -> None:
        flight = self._in_flight[0] if self._in_flight else None
        if flight is not None and time.monotonic() - flight.started > self.step_timeout_s:
            raise EngineDeadError(
                f"no result for step {flight.batch.step_id} within {self.step_timeout_s:g}s "
                "(--step-timeout-s)"
            )

    def _check_workers(self) -> None:
        """Every rank must heartbeat: a worker known only by a step subscription could be
        any peer (a stray connection subscribes too), so silence is death."""
        now = time.monotonic()
        for rank, last in self._worker_beats.items():
            if now - last > self.worker_silence_s and not self.stop.is_set():
                raise EngineDeadError(f"worker rank {rank} sent no heartbeat for "
                                      f"{now - last:.0f}s")

    def _watch_subscriptions(self) -> None:
        # a worker's SUB subscribes to everything: exactly b"\x01" when it connects and
        # b"\x00" when it goes away. Anything else is some other peer's noise (counted),
        # and must not stop the engine.
        steps = self.sockets.steps
        while steps.poll(0, zmq.POLLIN):
            event = steps.recv()
            if event == b"\x01":
                self._subscribers += 1
            elif event == b"\x00":
                self._subscribers -= 1
                # while the scheduler itself is stopping, workers leaving is the shutdown
                # (a stack stopped as a whole signals them all at once), not an engine death
                if self._subscribers < self.num_workers and not self.stop.is_set():
                    raise EngineDeadError("a worker disconnected")
            else:
                self.counter.record("scheduler_step", "not_a_subscription", event[:16], "ignored")

    def _log_idle(self) -> None:
        st = self.scheduler.stats()
        log.info(
            "idle: running=%d waiting=%d kv_usage=%.4f prefix_hits=%d/%d preemptions=%d "
            "invariant_failures=%d malformed_frames=%d",
            st.running, st.waiting, st.kv_usage, st.prefix_cache_hits, st.prefix_cache_queries,
            st.num_preemptions, st.invariant_failures, self.counter.count(),
        )

    # -- frontends -------------------------------------------------------------------
    def _take_frontend_messages(self) -> None:
        frontends = self.sockets.frontends
        while frontends.poll(0, zmq.POLLIN):
            frames = frontends.recv_multipart(copy=False)
            msg = safe_decode(frames, FRONTEND_TO_SCHEDULER, self.counter, num_frames=2)
            if msg is None:
                continue
            identity = frames[0].bytes
            if isinstance(msg, AddRequest):
                self._add(identity, msg)
            elif isinstance(msg, AbortRequest):
                own = [internal_id(identity, rid) for rid in msg.request_ids
                       if self.router.owns(identity, rid)]  # only the owner may abort
                self._abort(own, msg.index)
            elif isinstance(msg, Heartbeat):
                self._heartbeats[identity] = time.monotonic()
                self._send(identity, self.engine_stats())

    def _add(self, identity: bytes, msg: AddRequest) -> None:
        sched, engine = self.scheduler, self.config.engine
        if self.router.owns(identity, msg.request_id):
            self._send_error(identity, msg.request_id, "duplicate_id",
                             f"request id {msg.request_id!r} is already in use")
            return
        # the bound is on sequences that must wait: those the next step can admit into
        # free running slots are not queued (several requests often arrive between steps)
        free_slots = max(0, engine.max_num_seqs - len(sched.running))
        queued = max(0, len(sched.waiting) + msg.sampling_params.n - free_slots)
        if queued > engine.max_queued_requests:
            self._send_error(identity, msg.request_id, "overloaded",
                             f"{len(sched.waiting)} sequences are waiting and "
                             f"{len(sched.running)} running; retry later")
            return
        iid = self.router.add(identity, msg.request_id)
        try:
            sched.add_request(iid, msg.prompt_token_ids, msg.sampling_params, msg.priority,
                              arrival_time=msg.arrival_time)
        except RequestRejected as e:
            self.router.forget(iid)
            self._send_error(identity, msg.request_id, e.code, str(e))
            return
        self._ahead_blocked = False  # it may run in the step ahead

    def _abort(self, iids: list[str], index: int | None = None) -> None:
        if self._in_flight:
            self._deferred_aborts.append((iids, index))
            return
        sched = self.scheduler
        had_work = sched.has_unfinished_requests()
        self._send_outputs(sched.abort_request(iids, index))
        # between steps an abort can empty the scheduler with no step left to end: say
        # so here, as a step's end would (operators and tests read the idle line)
        if had_work and not sched.has_unfinished_requests():
            self._log_idle()

    def engine_stats(self) -> EngineStats:
        sched = self.scheduler
        return sched.metrics.snapshot(sched.stats(), self.counter, self.info, self.kv_events)

    def _drop_silent_frontends(self) -> None:
        """A frontend that heartbeats and then falls silent is gone (killed, partitioned,
        paused): its requests are aborted even if none of them has produced output yet,
        and each is answered with a ``frontend_timeout`` error first, so a frontend that
        comes back fails them instead of waiting for outputs that will never come."""
        now = time.monotonic()
        if now - self._last_silence_check < 1.0:
            return
        self._last_silence_check = now
        for identity, last in list(self._heartbeats.items()):
            if now - last > self.frontend_silence_s:
                del self._heartbeats[identity]
                iids = self.router.requests_of(identity)
                if iids:
                    log.warning("frontend %s silent for %.0fs: aborting its requests",
                                identity.hex(), now - last)
                    message = (f"the scheduler dropped this request: its frontend did not "
                               f"heartbeat for {now - last:.0f} s")
                    for iid in iids:
                        owner = self.router.owner(iid)
                        if owner is not None:
                            self._send_quietly(owner[0], RequestError(
                                owner[1], "frontend_timeout", message))
                    self._abort(iids)

    def _send_outputs(self, outputs: list[EngineOutput]) -> None:
        if not outputs:
            return
        requests = self.scheduler.requests
        finished = {o.request_id for o in outputs if o.finished and o.request_id not in requests}
        for identity, outs in self.router.route(outputs, finished).items():
            self._send(identity, EngineOutputs(outs))

    def _send_request_errors(self) -> None:
        """Requests the core failed after admission (a grammar that did not compile)."""
        for iid, code, message in self.scheduler.take_errors():
            owner = self.router.owner(iid)
            self.router.forget(iid)
            if owner is not None:
                self._send_error(owner[0], owner[1], code, message)

    def _send_error(self, identity: bytes, request_id: str, code: str, message: str) -> None:
        self._send(identity, RequestError(request_id, code, message))

    def _send(self, identity: bytes, msg: EngineOutputs | RequestError | EngineStats) -> None:
        try:
            self.sockets.frontends.send_multipart([identity, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EHOSTUNREACH: gone; EAGAIN: not reading
            log.warning("frontend %s unreachable (%s): aborting its requests", identity.hex(),
                        e.strerror)
            self._heartbeats.pop(identity, None)
            if self.router.requests_of(identity):
                self._abort(self.router.requests_of(identity))

    # -- the end ---------------------------------------------------------------------
    def _abort_everything(self, message: str, code: str) -> None:
        sched, router = self.scheduler, self.router
        for iid in router.all_requests():
            owner = router.owner(iid)
            sched.abort_request([iid])
            router.forget(iid)
            if owner is not None:
                self._send_quietly(owner[0], RequestError(owner[1], code, message))

    def _tell_frontends_engine_dead(self, message: str) -> None:
        for identity in self._heartbeats:
            self._send_quietly(identity, RequestError("", "engine_error", message))

    def _send_quietly(self, identity: bytes, msg: RequestError) -> None:
        try:
            self.sockets.frontends.send_multipart([identity, encode(msg)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # that frontend is gone too


def served_model_name(config: PagodaConfig) -> str:
    """The ``model_name`` label of vLLM's metrics: the first served name (as the frontends
    answer to), else the model setting as given."""
    names = [n.strip() for n in (config.process.served_model_name or "").split(",") if n.strip()]
    return names[0] if names else config.engine.model
