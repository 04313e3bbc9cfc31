"""`pagoda worker` on one node of a tensor-parallel group: start its ranks, supervise them.

A group of M ranks spread over K nodes (``--nnodes``) runs ranks ``R*M/K .. (R+1)*M/K-1``
on node R (``--node-rank``), each a worker process of its own (``--rank``), all joining
the rendezvous at ``--master-addr:--master-port`` (rank 0's node). This is what a
container or a Kubernetes pod runs; ``pagoda serve`` starts each rank itself instead.

The node process only supervises: a rank that exits takes the others down (SIGTERM,
then SIGKILL after a grace) and the node exits with that rank's status, so a group never
runs with a rank missing; SIGTERM/SIGINT is passed on to every rank. Each rank gets
SIGTERM if the node process dies.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from shared.config import PagodaConfig
from shared.ipc import die_with_parent, usable_cpus

log = logging.getLogger("pagoda.worker.node")
STOP_GRACE_S = 30.0  # a rank's own shutdown, before SIGKILL
POLL_S = 0.2  # how often the supervisor looks at its ranks


def runs_a_node(config: PagodaConfig, argv: list[str]) -> bool:
    """True when this command is a node's (no ``--rank`` or ``PAGODA_RANK`` given) of a
    tensor-parallel group; a single rank is run in-process otherwise."""
    explicit = (any(a == "--rank" or a.startswith("--rank=") for a in argv)
                or "PAGODA_RANK" in os.environ)
    return not explicit and config.engine.tensor_parallel_size > 1


def local_ranks(config: PagodaConfig) -> range:
    per_node = config.engine.tensor_parallel_size // config.process.nnodes
    first = config.process.node_rank * per_node
    return range(first, first + per_node)


def run_node(config: PagodaConfig, argv: list[str], threads: int | None) -> int:
    ranks = local_ranks(config)
    threads = threads or max(1, usable_cpus() // len(ranks))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    procs: dict[int, subprocess.Popen[bytes]] = {}
    for rank in ranks:
        # preexec_fn: one prctl call (PR_SET_PDEATHSIG), no lock a thread could hold
        procs[rank] = subprocess.Popen(
            [sys.executable, "-m", "services.worker.main", *argv, "--rank", str(rank),
             "--threads", str(threads)],
            preexec_fn=die_with_parent,  # noqa: PLW1509
            cwd=Path(__file__).resolve().parents[2],
        )
    log.info("node %d of %d: ranks %s (pids %s), %d threads each", config.process.node_rank,
             config.process.nnodes, list(ranks), [p.pid for p in procs.values()], threads)
    code = 0
    while not stop.wait(POLL_S):
        exited = [(rank, p.returncode) for rank, p in procs.items() if p.poll() is not None]
        if exited:
            rank, code = exited[0]
            log.error("rank %d exited with %s; stopping the node's other ranks", rank, code)
            code = code or 1  # a rank gone on its own is a failure of the group
            break
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs.values():
        try:
            p.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    codes = [p.returncode for p in procs.values()]
    return code or next((c for c in codes if c), 0)
