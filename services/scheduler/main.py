"""The scheduler process: ``python -m services.scheduler.main [flags / PAGODA_* env]``.

Binds its three sockets, waits for every worker's ready handshake and builds the
scheduler core from it (``handshake.py``; with ``--kv-events-endpoint`` also the KV
events publisher, closed with the other sockets), reports ready to its parent (``--ready-fd``,
used by ``pagoda serve``), then runs the step loop (``loop.py``) until SIGTERM/SIGINT.
On shutdown every request still held is answered with a typed error, so no client
waits forever; when the engine dies the process exits 1.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

import zmq

from services.scheduler.handshake import EngineDeadError, SchedulerSockets, wait_for_workers
from services.scheduler.kv_events import binds_endpoint
from services.scheduler.loop import SchedulerLoop
from shared.codec import MalformedFrameCounter
from shared.config import ConfigError, add_arguments, load_config
from shared.ipc import report_ready

log = logging.getLogger("pagoda.scheduler")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda scheduler", description="run the scheduler")
    parser.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    try:
        config = load_config(args)
        kv_events = config.process.kv_events_endpoint
        config.process.load_curve_keys(  # a connected KV events socket is a CURVE client
            binds=True, connects=kv_events is not None and not binds_endpoint(kv_events))
    except ConfigError as e:
        print(f"pagoda scheduler: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    counter = MalformedFrameCounter(log)
    try:
        sockets = SchedulerSockets.bind(config)
    except (ValueError, zmq.ZMQError) as e:  # an address refused or in use
        log.error("start-up failed: %s", e)
        return 1
    try:
        try:
            sched = wait_for_workers(sockets, config, counter, stop)
        except EngineDeadError as e:
            log.error("start-up failed: %s", e)
            return 1
        log.info("scheduler ready: %d KV blocks, max_model_len %d", sched.config.num_blocks,
                 sched.config.max_model_len)
        if sockets.kv_events is not None:
            proc = config.process
            log.info("KV cache events on %s (topic %r, %s encoding)", proc.kv_events_endpoint,
                     proc.kv_events_topic, proc.kv_events_encoding)
        if args.ready_fd is not None:
            report_ready(args.ready_fd, role="scheduler", num_kv_blocks=sched.config.num_blocks,
                         max_model_len=sched.config.max_model_len)
        return SchedulerLoop(sched, sockets, config, counter, stop).run()
    finally:
        if sockets.kv_events is not None:
            log.info("KV cache events: %d batches sent, %d dropped", sockets.kv_events.published,
                     sockets.kv_events.dropped)
        sockets.close()


if __name__ == "__main__":
    sys.exit(main())
