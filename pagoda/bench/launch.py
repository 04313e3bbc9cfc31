"""``--launch``: a local stack (``pagoda serve``'s launcher) for the length of a run.

The stack runs as child processes (worker, scheduler, frontends) on ipc:// sockets in a
private run directory, with the HTTP API on a free loopback port; the benchmark talks
to it as to any running server and stops it afterwards, whatever happened.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pagoda.launcher import Stack
from shared.config import Endpoints, load_config
from shared.ipc import private_run_dir


@dataclass(frozen=True)
class StackAddresses:
    http_base: str  # http://127.0.0.1:PORT/v1
    metrics_url: str  # http://127.0.0.1:PORT/metrics
    native: tuple[str, ...]  # one native-API address per frontend
    pids: dict[str, int]  # child name (worker-0, scheduler, frontend-0, ...) -> process id


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def launched_stack(model_dir: str, num_frontends: int = 1,
                   engine: dict[str, Any] | None = None,
                   worker_command: tuple[str, list[str]] | None = None,
                   ) -> Iterator[StackAddresses]:
    """Starts the stack, yields where to reach it, stops it. ``engine``: more settings
    (``max_num_seqs``, ``kv_cache_bytes``, ...), as ``pagoda serve`` flags name them;
    ``worker_command``: a stand-in worker (``pagoda.launcher.Stack``)."""
    port = free_port()
    with private_run_dir() as run_dir:
        settings = {"model": model_dir, "num_frontends": num_frontends, "http_host": "127.0.0.1",
                    "http_port": port, **(engine or {})}
        # env={}: the run is defined by its flags, not by PAGODA_* variables of the shell
        config = load_config(settings, env={},
                             default_endpoints=Endpoints.local(run_dir, num_frontends))
        stack = Stack(config, worker_command)
        try:
            stack.start()
            base = f"http://127.0.0.1:{port}"
            yield StackAddresses(f"{base}/v1", f"{base}/metrics", config.endpoints.frontend_native,
                                 {c.name: c.proc.pid for c in stack.children})
        finally:
            stack.stop()
