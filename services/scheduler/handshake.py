"""The scheduler process's sockets and its start-up handshake with the workers.

Sockets (addresses in ``shared.config.Endpoints``):
- ``frontends``: ROUTER (binds); each frontend's DEALER identity owns its requests.
  In: AddRequest, AbortRequest, Heartbeat. Out: EngineOutputs (one per step per
  frontend), RequestError, EngineStats.
- ``steps``: XPUB (binds); every worker rank's SUB gets each StepBatch. Subscription
  events tell the loop when a worker connects or goes away.
- ``results``: PULL (binds); WorkerReady from every rank at start-up, then StepResult
  from rank 0.
- ``kv_events`` (only with ``--kv-events-endpoint``): an XPUB for vLLM-format KV cache
  events to gateways (``services/scheduler/kv_events.py``); out only.

``wait_for_workers`` collects every rank's ``WorkerReady`` and step subscription and
builds the ``Scheduler`` from them, so the step loop (``services/scheduler/loop.py``)
starts with a complete core and never holds a half-built one.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from services.scheduler.kv_events import KVEventPublisher
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.scheduler.structured_output import StructuredOutputManager
from shared.codec import MalformedFrameCounter, safe_decode
from shared.config import PagodaConfig
from shared.curve import ZapAuthenticator, start_authenticator
from shared.heap import freeze_startup_heap
from shared.ipc import make_socket, wait_for_subscribers
from shared.protocol import WORKER_TO_SCHEDULER, WorkerReady

POLL_MS = 200  # how often a blocked wait looks at the stop flag


class EngineDeadError(RuntimeError):
    """A worker vanished or stopped answering; the stack cannot go on."""


@dataclass
class SchedulerSockets:
    ctx: zmq.Context[Any]
    frontends: zmq.Socket[Any]
    steps: zmq.Socket[Any]
    results: zmq.Socket[Any]
    addresses: tuple[str, ...]  # the bound ones, whose ipc files we remove
    kv_events: KVEventPublisher | None = None
    authenticator: ZapAuthenticator | None = None  # with CURVE: who may connect

    @classmethod
    def bind(cls, config: PagodaConfig) -> SchedulerSockets:
        ep, proc = config.endpoints, config.process
        curve = proc.load_curve_keys()
        opts: dict[str, Any] = {"sndhwm": proc.socket_hwm, "rcvhwm": proc.socket_hwm,
                                "max_msg_size": proc.max_frame_bytes,
                                "allow_wildcard": proc.allow_wildcard_bind, "curve": curve}
        ctx: zmq.Context[Any] = zmq.Context()
        opened: list[zmq.Socket[Any]] = []
        authenticator = None
        try:
            authenticator = start_authenticator(ctx, curve)
            for kind, address in ((zmq.ROUTER, ep.scheduler_frontend), (zmq.XPUB, ep.scheduler_step),
                                  (zmq.PULL, ep.scheduler_result)):
                opened.append(make_socket(ctx, kind, address, **opts))
            addresses: tuple[str, ...] = (ep.scheduler_frontend, ep.scheduler_step,
                                          ep.scheduler_result)
            kv_events = None
            if proc.kv_events_endpoint is not None:
                kv_events = KVEventPublisher.open(
                    ctx, proc.kv_events_endpoint, topic=proc.kv_events_topic,
                    encoding=proc.kv_events_encoding, hwm=proc.socket_hwm,
                    allow_wildcard=proc.allow_wildcard_bind, curve=curve)
                opened.append(kv_events.sock)
                if proc.kv_events_endpoint.startswith("ipc://"):
                    addresses += (proc.kv_events_endpoint,)
        except BaseException:
            for sock in opened:
                sock.close(linger=0)
            if authenticator is not None:
                authenticator.stop()
            ctx.term()
            raise
        frontends, steps, results = opened[:3]
        return cls(ctx, frontends, steps, results, addresses=addresses, kv_events=kv_events,
                   authenticator=authenticator)

    def close(self) -> None:
        for sock in (self.frontends, self.steps, self.results):
            sock.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()
        # libzmq leaves ipc:// socket files behind; the binder removes its own
        for address in self.addresses:
            if address.startswith("ipc://"):
                with contextlib.suppress(OSError):
                    os.unlink(address[len("ipc://"):])


def wait_for_workers(
    sockets: SchedulerSockets, config: PagodaConfig, counter: MalformedFrameCounter,
    stop: threading.Event,
) -> Scheduler:
    """Every rank's WorkerReady and step subscription; the core built from them.

    Raises EngineDeadError when not every rank reported within the start-up timeout.
    """
    num_workers = config.engine.tensor_parallel_size
    deadline = time.monotonic() + config.process.startup_timeout_s
    ready: dict[int, WorkerReady] = {}
    while len(ready) < num_workers:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 or stop.is_set():
            raise EngineDeadError(f"{len(ready)} of {num_workers} workers reported ready")
        if sockets.results.poll(min(remaining_ms, POLL_MS), zmq.POLLIN):
            msg = safe_decode(sockets.results.recv_multipart(copy=False), WORKER_TO_SCHEDULER, counter)
            if isinstance(msg, WorkerReady):
                ready[msg.rank] = msg
    subscribed = wait_for_subscribers(sockets.steps, num_workers,
                                      max(0.1, deadline - time.monotonic()))
    if subscribed < num_workers:
        raise EngineDeadError(f"{subscribed} of {num_workers} workers subscribed to steps")
    first = ready[min(ready)]
    engine = config.engine
    # structured output compiles grammars over the vocabulary of the model's tokenizer
    # (loaded from --model, a directory: `pagoda scheduler` resolves a name first)
    structured_output = StructuredOutputManager(
        Path(engine.model), first.vocab_size, first.eos_token_ids,
        compile_timeout_s=engine.grammar_compile_timeout_s, cache_size=engine.grammar_cache_size)
    scheduler = Scheduler(SchedulerConfig.from_settings(
        engine,
        num_blocks=min(r.num_kv_blocks for r in ready.values()),
        max_model_len=min(r.max_model_len for r in ready.values()),
        vocab_size=first.vocab_size,
        eos_token_ids=tuple(first.eos_token_ids),
        # tests run the stack with PAGODA_TESTING=1: a broken invariant is fatal there
        strict_invariants=config.process.testing,
        enable_kv_events=sockets.kv_events is not None,
    ), structured_output=structured_output)
    # the block pool and request table live as long as the process (shared/heap.py)
    freeze_startup_heap()
    return scheduler
