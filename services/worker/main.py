"""The worker process: holds the model and the KV cache and executes the scheduler's steps.

    python -m services.worker.main --model DIR [--rank N] [flags / PAGODA_* env: shared/config.py]

The model setting must be a model directory: ``pagoda worker`` (pagoda/cli.py) resolves a
name such as ``smollm2`` to its directory in the cache before it starts this.

Start-up: build the model runner, connect a SUB to the scheduler's step XPUB and a
PUSH to its result PULL, send ``WorkerReady`` (the KV capacity handshake), then loop:
every rank receives every ``StepBatch`` and executes it; rank 0 sends the
``StepResult`` back. A malformed frame is dropped and counted. An exception inside a
step is fatal (the KV cache may be half-written): the process exits non-zero and the
scheduler and the launcher take the stack down loudly. A thread of its own sends a
``WorkerHeartbeat`` every ``HEARTBEAT_S`` on a second PUSH, whatever the step loop is
doing: the scheduler knows its workers are alive by these.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from services.worker.node import run_node, runs_a_node
from services.worker.parallel import (
    SINGLE,
    TensorParallel,
    destroy_tensor_parallel,
    init_tensor_parallel,
)
from services.worker.runner_builder import RunnerSpec, build_runner, resolve_device
from shared.codec import MalformedFrameCounter, encode, safe_decode
from shared.config import ConfigError, PagodaConfig, add_arguments, load_config, require_model_dir
from shared.curve import CurveKeys
from shared.faults import FaultPoint
from shared.heap import freeze_startup_heap
from shared.ipc import make_socket, report_ready
from shared.protocol import SCHEDULER_TO_WORKER, WorkerHeartbeat, WorkerReady

log = logging.getLogger("pagoda.worker")
POLL_MS = 200  # how often the loop looks at the stop flag while idle
HEARTBEAT_S = 1.0
# the scheduler link down this long (its process gone): exit 1. Long enough for
# `pagoda serve`'s shutdown, which stops the scheduler first, to reach the worker.
SCHEDULER_GONE_S = 3.0


class SchedulerLink:
    """The step socket and a monitor of its connection: when the scheduler's process is
    gone (the link drops) the engine it ran is gone too, and this worker's state with it."""

    def __init__(self, steps: zmq.Socket[Any]) -> None:
        self.steps = steps
        self._monitor = steps.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        self._poller = zmq.Poller()
        self._poller.register(steps, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._gone_since: float | None = None

    def poll(self, timeout_ms: int) -> bool:
        """True when a step frame is waiting."""
        events = dict(self._poller.poll(timeout_ms))
        if self._monitor in events:
            while self._monitor.poll(0, zmq.POLLIN):
                event = recv_monitor_message(self._monitor)["event"]
                if event == zmq.EVENT_DISCONNECTED and self._gone_since is None:
                    self._gone_since = time.monotonic()
        return self.steps in events

    def gone_for(self) -> float:
        """Seconds since the link dropped (0 while it is up). A drop is never undone by a
        reconnect: the scheduler that answers then is a new one, or one that has already
        declared this engine dead."""
        return 0.0 if self._gone_since is None else time.monotonic() - self._gone_since

    def close(self) -> None:
        self.steps.disable_monitor()
        self._monitor.close(linger=0)


def heartbeat(ctx: zmq.Context[Any], address: str, rank: int, stop: threading.Event,
              period_s: float = HEARTBEAT_S, curve: CurveKeys | None = None) -> None:
    """Send WorkerHeartbeat(rank) every ``period_s`` until ``stop`` (a thread's body; its
    own socket, as ZMQ sockets are not shared between threads)."""
    sock = make_socket(ctx, zmq.PUSH, address, sndhwm=4, curve=curve)
    beat = encode(WorkerHeartbeat(rank))
    try:
        while not stop.wait(period_s):  # a period, not a synchronisation
            try:
                sock.send(beat, flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # the scheduler is not reading; it will notice the silence
    finally:
        sock.close(linger=0)


def run_worker(config: PagodaConfig, ready_fd: int | None = None,
               stop: threading.Event | None = None) -> int:
    engine, endpoints, rank = config.engine, config.endpoints, config.process.rank
    stop = stop or threading.Event()
    model_dir = require_model_dir(engine.model, "worker")
    tp = join_group(config)
    try:
        built = build_runner(model_dir, RunnerSpec.from_settings(engine), tp)
    except BaseException:
        destroy_tensor_parallel(tp)
        raise
    runner = built.runner
    freeze_startup_heap()  # the model and runner live as long as the process
    counter = MalformedFrameCounter(log)
    ctx: zmq.Context[Any] = zmq.Context()
    hwm, curve = config.process.socket_hwm, config.process.load_curve_keys()
    steps = make_socket(ctx, zmq.SUB, endpoints.scheduler_step, sndhwm=hwm, rcvhwm=hwm,
                        curve=curve)
    results = make_socket(ctx, zmq.PUSH, endpoints.scheduler_result, sndhwm=hwm, rcvhwm=hwm,
                          curve=curve)
    fault = FaultPoint("worker", config.process.fault)  # tests only (shared/faults.py)
    beats_stop = threading.Event()
    link: SchedulerLink | None = None
    beating = threading.Thread(target=heartbeat, name="worker-heartbeat", daemon=True,
                               args=(ctx, endpoints.scheduler_result, rank, beats_stop),
                               kwargs={"curve": curve})
    try:
        results.send(encode(WorkerReady(
            rank=rank, num_kv_blocks=built.num_blocks, block_size=engine.block_size,
            max_model_len=built.max_model_len, vocab_size=built.model_config.vocab_size,
            eos_token_ids=list(built.model_config.eos_token_ids),
        )))
        log.info("worker %d ready: %d KV blocks of %d tokens, max_model_len %d", rank,
                 built.num_blocks, engine.block_size, built.max_model_len)
        if ready_fd is not None:
            report_ready(ready_fd, role="worker", rank=rank, num_kv_blocks=built.num_blocks)
        beating.start()
        link = SchedulerLink(steps)
        while not stop.is_set():
            if not link.poll(POLL_MS):
                if link.gone_for() > SCHEDULER_GONE_S and not stop.is_set():
                    log.error("the scheduler went away %.0f s ago; exiting, as a worker serves "
                              "one scheduler's engine (a supervisor restarts it for the next)",
                              link.gone_for())
                    return 1
                continue
            batch = safe_decode(steps.recv_multipart(copy=False), SCHEDULER_TO_WORKER, counter)
            if batch is None:
                continue
            frame_fault = fault.step()
            result = runner.execute(batch)
            if rank == 0 and frame_fault != "drop":
                frame = encode(result)
                results.send(frame)
                if frame_fault == "dup":
                    results.send(frame)
    finally:
        beats_stop.set()
        if beating.is_alive():
            beating.join()
        if link is not None:
            link.close()
        steps.close()
        results.close()
        ctx.term()
        destroy_tensor_parallel(tp)
    return 0


def join_group(config: PagodaConfig) -> TensorParallel:
    """This rank's tensor-parallel group (the group of one without tensor parallelism).
    Ranks may start ``startup_timeout_s`` apart; a step's collectives time out with the
    step (``step_timeout_s``), so a dead or hung rank fails the others, never hangs them."""
    engine, proc = config.engine, config.process
    if engine.tensor_parallel_size == 1:
        return SINGLE
    init_method = f"tcp://{proc.master_addr}:{proc.master_port}"
    return init_tensor_parallel(proc.rank, engine.tensor_parallel_size, init_method,
                                resolve_device(engine.device), proc.startup_timeout_s,
                                proc.step_timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda worker", description="run one worker rank")
    parser.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    add_arguments(parser, groups=("endpoints", "engine", "process"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    try:
        config = load_config(args)
        require_model_dir(config.engine.model, "worker")
        config.process.load_curve_keys(connects=True)
        if config.engine.tensor_parallel_size > 1 and config.process.master_port is None:
            raise ConfigError("master_port: a tensor-parallel group needs its rendezvous port "
                              "(--master-port; pagoda serve picks one)")
    except ConfigError as e:
        print(f"pagoda worker: {e}", file=sys.stderr)
        return 2
    given = sys.argv[1:] if argv is None else argv
    if runs_a_node(config, given):
        return run_node(config, given, args.threads)
    if args.threads:
        torch.set_num_threads(args.threads)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return run_worker(config, args.ready_fd, stop)


if __name__ == "__main__":
    sys.exit(main())
