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
from typing import Any

import torch
import zmq

from services.worker.runner_builder import RunnerSpec, build_runner
from shared.codec import MalformedFrameCounter, encode, safe_decode
from shared.config import ConfigError, PagodaConfig, add_arguments, load_config, require_model_dir
from shared.faults import FaultPoint
from shared.ipc import make_socket, report_ready
from shared.protocol import SCHEDULER_TO_WORKER, WorkerHeartbeat, WorkerReady

log = logging.getLogger("pagoda.worker")
POLL_MS = 200  # how often the loop looks at the stop flag while idle
HEARTBEAT_S = 1.0


def heartbeat(ctx: zmq.Context[Any], address: str, rank: int, stop: threading.Event,
              period_s: float = HEARTBEAT_S) -> None:
    """Send WorkerHeartbeat(rank) every ``period_s`` until ``stop`` (a thread's body; its
    own socket, as ZMQ sockets are not shared between threads)."""
    sock = make_socket(ctx, zmq.PUSH, address, sndhwm=4)
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
    built = build_runner(model_dir, RunnerSpec.from_settings(engine))
    runner = built.runner
    counter = MalformedFrameCounter(log)
    ctx: zmq.Context[Any] = zmq.Context()
    hwm = config.process.socket_hwm
    steps = make_socket(ctx, zmq.SUB, endpoints.scheduler_step, sndhwm=hwm, rcvhwm=hwm)
    results = make_socket(ctx, zmq.PUSH, endpoints.scheduler_result, sndhwm=hwm, rcvhwm=hwm)
    fault = FaultPoint("worker", config.process.fault)  # tests only (shared/faults.py)
    beats_stop = threading.Event()
    beating = threading.Thread(target=heartbeat, name="worker-heartbeat", daemon=True,
                               args=(ctx, endpoints.scheduler_result, rank, beats_stop))
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
        while not stop.is_set():
            if not steps.poll(POLL_MS, zmq.POLLIN):
                continue
            batch = safe_decode(steps.recv_multipart(copy=False), SCHEDULER_TO_WORKER, counter)
            if batch is None:
                continue
            fault.step()
            result = runner.execute(batch)
            if rank == 0:
                results.send(encode(result))
    finally:
        beats_stop.set()
        if beating.is_alive():
            beating.join()
        steps.close()
        results.close()
        ctx.term()
    return 0


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
    except ConfigError as e:
        print(f"pagoda worker: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return run_worker(config, args.ready_fd, stop)


if __name__ == "__main__":
    sys.exit(main())
