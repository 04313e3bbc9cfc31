"""A benchmark's stand-in worker: the real worker protocol, no model, a fixed step time.

    (started by pagoda.bench.pipeline_ceiling in place of services.worker.main)

It measures what the rest of the pipeline (scheduler, frontends, HTTP, client) can
carry: at a GPU's pace (20k+ output tokens/s, a step every few milliseconds) the
scheduler's loop, the step messages and the frontends' detokenization, not the model,
set the ceiling. It connects, reports ``WorkerReady`` from the model directory's
config (vocabulary, EOS ids, ``max_model_len``) with ``num_kv_blocks`` blocks,
heartbeats as a worker does, and answers every ``StepBatch`` after ``--step-ms``
(the emulated forward pass: a sleep, which leaves the CPU to the other processes as
a GPU would). It keeps the same request table as the model runner and checks the
deltas against it, so a scheduler bug shows here too. Each sampled token is the
sequence's prompt read cyclically: real text for the detokenizers, never EOS unless
the prompt holds one (benchmarks run with ``ignore_eos``).

Not a product path: nothing in ``services/`` imports it.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
import time
from typing import Any

import zmq

from services.worker.main import POLL_MS, SchedulerLink, heartbeat
from shared import model_limits
from shared.codec import MalformedFrameCounter, encode, safe_decode
from shared.config import ConfigError, PagodaConfig, add_arguments, load_config, require_model_dir
from shared.ipc import make_socket, report_ready
from shared.protocol import SCHEDULER_TO_WORKER, StepBatch, StepResult, WorkerReady

log = logging.getLogger("pagoda.synthetic_worker")
DEFAULT_NUM_BLOCKS = 65536


class SyntheticRunner:
    """The model runner's request table and checks; tokens from the prompt, no model."""

    def __init__(self) -> None:
        # seq id -> [token ids, number of prompt tokens, computed tokens, blocks]
        self.seqs: dict[int, list[Any]] = {}
        self.block_size = 0

    def execute(self, batch: StepBatch) -> StepResult:
        for sid in batch.finished_request_ids:
            self.seqs.pop(sid, None)
        for new in batch.new_requests:
            self.seqs[new.request_id] = [list(new.token_ids), new.num_prompt_tokens,
                                         new.num_computed_tokens, len(new.block_ids)]
        for running in batch.running_requests:
            self.seqs[running.request_id][3] += len(running.new_block_ids)
        result = StepResult(step_id=batch.step_id)
        for sid, n in zip(batch.scheduled_request_ids, batch.num_scheduled_tokens, strict=True):
            seq = self.seqs[sid]  # a KeyError: a scheduled sequence the worker never got
            tokens, num_prompt = seq[0], seq[1]
            seq[2] += n
            if seq[2] > len(tokens):
                raise RuntimeError(f"sequence {sid}: step computes past its known tokens")
            if seq[2] == len(tokens):
                token = tokens[(len(tokens) - num_prompt) % num_prompt]
                tokens.append(token)
                result.request_ids.append(sid)
                result.sampled_token_ids.append(token)
        return result


def run(config: PagodaConfig, step_s: float, num_blocks: int, ready_fd: int | None,
        stop: threading.Event, stats_file: str | None = None) -> int:
    engine, endpoints = config.engine, config.endpoints
    model_dir = require_model_dir(engine.model, "worker")
    cfg = json.loads((model_dir / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    runner = SyntheticRunner()
    counter = MalformedFrameCounter(log)
    ctx: zmq.Context[Any] = zmq.Context()
    steps = make_socket(ctx, zmq.SUB, endpoints.scheduler_step)
    results = make_socket(ctx, zmq.PUSH, endpoints.scheduler_result)
    beats_stop = threading.Event()
    beating = threading.Thread(target=heartbeat, daemon=True,
                               args=(ctx, endpoints.scheduler_result, 0, beats_stop))
    link = SchedulerLink(steps)
    busy_s, num_steps = 0.0, 0
    try:
        results.send(encode(WorkerReady(
            rank=0, num_kv_blocks=num_blocks, block_size=engine.block_size,
            max_model_len=model_limits.max_model_len(cfg, engine.max_model_len),
            vocab_size=int(cfg["vocab_size"]), eos_token_ids=eos_ids)))
        if ready_fd is not None:
            report_ready(ready_fd, role="worker", rank=0, num_kv_blocks=num_blocks)
        beating.start()
        while not stop.is_set():
            if not link.poll(POLL_MS):
                if link.gone_for() > 3.0:
                    return 1
                continue
            batch = safe_decode(steps.recv_multipart(copy=False), SCHEDULER_TO_WORKER, counter)
            if not isinstance(batch, StepBatch):
                continue
            start = time.perf_counter()
            result = runner.execute(batch)
            # the emulated forward pass (the step's whole time, its Python included)
            left = step_s - (time.perf_counter() - start)
            if left > 0:
                time.sleep(left)
            results.send(encode(result))
            busy_s += time.perf_counter() - start
            num_steps += 1
    finally:
        if stats_file:  # read by the bench once the stack has stopped
            with open(stats_file, "w") as f:
                json.dump({"steps": num_steps, "busy_s": busy_s}, f)
        beats_stop.set()
        if beating.is_alive():
            beating.join()
        link.close()
        steps.close()
        results.close()
        ctx.term()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda.bench.synthetic_worker")
    parser.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--step-ms", type=float, default=2.0)
    parser.add_argument("--synthetic-blocks", type=int, default=DEFAULT_NUM_BLOCKS)
    parser.add_argument("--stats-file", default=None, help="steps and busy seconds, at exit")
    add_arguments(parser, groups=("endpoints", "engine", "process"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    try:
        config = load_config(args)
    except ConfigError as e:
        print(f"synthetic worker: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    return run(config, args.step_ms / 1000, args.synthetic_blocks, args.ready_fd, stop,
               args.stats_file)


if __name__ == "__main__":
    sys.exit(main())
