"""The scheduler process: ``python -m services.scheduler.main [flags / PAGODA_* env]``.

Binds its three sockets, waits for every worker's ready handshake, reports ready to
its parent (``--ready-fd``, used by ``pagoda serve``), then runs the step loop of
``services/scheduler/server.py`` until SIGTERM/SIGINT. On shutdown every request
still held is answered with a typed error, so no client waits forever.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from services.scheduler.server import EngineDeadError, SchedulerServer
from shared.config import add_arguments, load_config
from shared.ipc import report_ready

log = logging.getLogger("pagoda.scheduler")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda scheduler", description="run the scheduler")
    parser.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s scheduler %(levelname)s %(message)s")
    config = load_config(args)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = SchedulerServer(config, stop)
    try:
        try:
            sched = server.wait_for_workers(config.process.startup_timeout_s)
        except EngineDeadError as e:
            log.error("start-up failed: %s", e)
            return 1
        log.info("scheduler ready: %d KV blocks, max_model_len %d", sched.config.num_blocks,
                 sched.config.max_model_len)
        if args.ready_fd is not None:
            report_ready(args.ready_fd, role="scheduler", num_kv_blocks=sched.config.num_blocks,
                         max_model_len=sched.config.max_model_len)
        return server.run()
    finally:
        server.close()


if __name__ == "__main__":
    sys.exit(main())
