"""``pagoda serve``: the whole stack on one machine, as child processes.

Starts the worker rank(s), the scheduler and N frontends, each the same command a
container runs (``python -m services.<role>.main``), with every setting passed as
``PAGODA_*`` environment variables (one resolution for all children; the model as the
directory ``pagoda.model_fetch`` resolves it to, its name as ``served_model_name``).
The default endpoints are ``ipc://`` files in a private 0700 run directory. Each child
reports ready through an inherited pipe; the launcher prints where to reach the stack.

Supervision: a child that exits takes the whole stack down (exit 1). SIGTERM or
SIGINT stops the frontends first (they abort what they hold), then the scheduler,
then the workers, each with a bounded wait before SIGKILL; the run directory goes
with them, so no process or socket file is left behind. Children also get SIGTERM
from the kernel if the launcher itself dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

from shared.config import (
    SETTINGS,
    ConfigError,
    Endpoints,
    PagodaConfig,
    add_arguments,
    load_config,
    resolve,
)
from shared.ipc import (
    ReadyError,
    die_with_parent,
    lower_cpu_priority,
    private_run_dir,
    usable_cpus,
    wait_ready,
)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    ready_fd: int


def config_env(config: PagodaConfig) -> dict[str, str]:
    """Every resolved setting as the PAGODA_* variable a child reads back."""
    values: dict[str, object] = {}
    for group in (config.endpoints, config.engine, config.process):
        values.update({f.name: getattr(group, f.name) for f in fields(group)})
    env = {}
    for s in SETTINGS:
        value = values[s.key]
        if value is None:
            text = "none"
        elif isinstance(value, bool):
            text = "1" if value else "0"
        elif isinstance(value, tuple):
            text = ",".join(value)
        else:
            text = str(value)
        env[s.env] = text
    return env


def free_tcp_port() -> int:
    """A loopback TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_child(name: str, module: str, args: list[str], env: dict[str, str],
                nice: int = 0) -> Child:
    """``nice``: how far below the launcher's CPU priority the child runs."""
    read_fd, write_fd = os.pipe()

    # preexec_fn: PR_SET_PDEATHSIG has no Popen equivalent; die_with_parent is one prctl
    # call and nice one syscall, taking no lock a thread of ours could hold across the fork
    def before_exec() -> None:
        die_with_parent()
        lower_cpu_priority(nice)

    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--ready-fd", str(write_fd), *args],
        env={**os.environ, **env}, pass_fds=(write_fd,),
        preexec_fn=before_exec,  # noqa: PLW1509
        cwd=Path(__file__).resolve().parent.parent,
    )
    os.close(write_fd)
    return Child(name, proc, read_fd)


FORCE_GRACE_S = 5.0  # after a second signal, before SIGKILL
# The scheduler and the workers drain nothing (they are stopped after the frontends,
# which end every stream first): this covers a step in flight (a CPU prefill chunk takes
# a second or two). A hung worker (the step watchdog's case) is killed after it, not
# after the frontends' drain time.
ENGINE_STOP_GRACE_S = 10.0
STOP_POLL_S = 0.05


class Stack:
    """The children of one ``pagoda serve``, in start order."""

    def __init__(self, config: PagodaConfig,
                 worker_command: tuple[str, list[str]] | None = None) -> None:
        """``worker_command``: (module, extra args) run in place of the worker (benchmarks:
        ``pagoda.bench.synthetic_worker``)."""
        self.config = config
        self.children: list[Child] = []
        self.worker_command = worker_command or ("services.worker.main", [])

    def start(self) -> None:
        env = config_env(self.config)
        ranks = self.config.engine.tensor_parallel_size
        # a tensor-parallel group shares the machine's cores between its ranks
        threads = [] if ranks == 1 else ["--threads", str(max(1, usable_cpus() // ranks))]
        module, extra = self.worker_command
        for rank in range(ranks):
            self.children.append(start_child(f"worker-{rank}", module,
                                             ["--rank", str(rank), *threads, *extra], env))
        # below the worker: their wake-ups must not stall its lockstep threads
        nice = self.config.process.service_nice
        self.children.append(start_child("scheduler", "services.scheduler.main", [], env, nice))
        for i in range(self.config.process.num_frontends):
            self.children.append(start_child(
                f"frontend-{i}", "services.tokenizer.main", ["--frontend-index", str(i)], env,
                nice))
        timeout = self.config.process.startup_timeout_s
        for child in self.children:
            try:
                wait_ready(child.ready_fd, timeout, is_alive=lambda c=child: c.proc.poll() is None)
            except ReadyError as e:
                raise ReadyError(f"{child.name}: {e}") from None

    def first_exited(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    def stop(self, force: threading.Event | None = None) -> bool:
        """Frontends first (their drain time and 10 s more before SIGKILL), then the
        scheduler, then the workers (``ENGINE_STOP_GRACE_S`` each group); True if every
        child exited 0. Once ``force`` is set (a second Ctrl-C / SIGTERM) the group being
        stopped gets a second SIGTERM (a frontend then skips its drain and ends its
        streams with ``abort``), and every child has at most ``FORCE_GRACE_S`` more,
        all groups together, before SIGKILL. The order holds when forced too: the
        scheduler stopping while a frontend still aborts its streams would fail them
        with its own ``shutting_down`` error instead."""
        force = force or threading.Event()
        # a frontend drains for shutdown_timeout_s, then aborts and flushes: wait longer
        frontend_grace = self.config.process.shutdown_timeout_s + 10.0
        forced_until: float | None = None  # the deadline of every child once forced
        for group, grace in (
            ([c for c in self.children if c.name.startswith("frontend")], frontend_grace),
            ([c for c in self.children if c.name == "scheduler"], ENGINE_STOP_GRACE_S),
            ([c for c in self.children if c.name.startswith("worker")], ENGINE_STOP_GRACE_S),
        ):
            for c in group:
                if c.proc.poll() is None:
                    c.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for c in group:
                while c.proc.poll() is None:
                    if force.is_set() and forced_until is None:
                        forced_until = time.monotonic() + FORCE_GRACE_S
                        self._signal_live(group, signal.SIGTERM)
                    if forced_until is not None:
                        deadline = min(deadline, forced_until)
                    if time.monotonic() >= deadline:
                        c.proc.kill()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        c.proc.wait(STOP_POLL_S)  # wakes at its exit; else to look at force
        return all(c.proc.wait() == 0 for c in self.children)

    @staticmethod
    def _signal_live(children: list[Child], sig: signal.Signals) -> None:
        for c in children:
            if c.proc.poll() is None:
                c.proc.send_signal(sig)


def serve(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagoda serve", description="run the whole stack locally")
    parser.add_argument("--frontends", type=int, dest="num_frontends", default=None,
                        help="frontend processes (same as --num-frontends)")
    add_arguments(parser)
    args = parser.parse_args(argv)
    from pagoda.model_fetch import resolve_model, served_model_names

    stop, force = threading.Event(), threading.Event()

    def on_signal(*_: object) -> None:  # the first asks to stop, the second to hurry
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    with private_run_dir() as run_dir:
        try:
            values = resolve(args)
            load_config(args, default_endpoints=Endpoints.local(run_dir, values["num_frontends"]))
        except ConfigError as e:  # before fetching anything
            print(f"pagoda serve: {e}", file=sys.stderr)
            return 2
        # resolve (fetch once) here: the children take only the directory, and the HTTP API
        # answers to the name as given (e.g. smollm2) unless --served-model-name says otherwise
        model_dir = resolve_model(values["model"], values["cache_dir"])
        served = values["served_model_name"] or served_model_names(
            values["model"], model_dir, values["cache_dir"])
        config = load_config({**vars(args), "model": str(model_dir), "served_model_name": served},
                             default_endpoints=Endpoints.local(run_dir, values["num_frontends"]))
        if config.engine.tensor_parallel_size > 1:
            from services.worker.step_relay import check_split

            try:  # before any process starts: sizes the group cannot split, named
                check_split(model_dir, config.engine.tensor_parallel_size)
            except ValueError as e:
                print(f"pagoda serve: {e}", file=sys.stderr)
                return 2
        if config.engine.tensor_parallel_size > 1 and config.process.master_port is None:
            # the group's rendezvous: rank 0 listens there (loopback, one host)
            config = replace(config, process=replace(config.process, master_port=free_tcp_port()))
        stack = Stack(config)
        try:
            stack.start()
        except ReadyError as e:
            print(f"pagoda serve: {e}", file=sys.stderr)
            stack.stop()
            return 1
        print(f"pagoda serve: ready, model {model_dir}", flush=True)
        print(f"  scheduler: frontends {config.endpoints.scheduler_frontend}, steps "
              f"{config.endpoints.scheduler_step}, results {config.endpoints.scheduler_result}")
        print("  processes: " + " ".join(f"{c.name}={c.proc.pid}" for c in stack.children))
        host = config.process.http_host
        host = f"[{host}]" if ":" in host else host
        print(f"  HTTP API: http://{host}:{config.process.http_port}/v1", flush=True)
        for i, address in enumerate(config.endpoints.frontend_native):
            print(f"  frontend {i} native API: {address}", flush=True)
        exit_code = 0
        while not stop.wait(0.2):
            dead = stack.first_exited()
            if dead is not None:
                print(f"pagoda serve: {dead.name} exited with {dead.proc.returncode}; stopping",
                      file=sys.stderr, flush=True)
                exit_code = 1
                stop.set()  # a signal now hurries the stop, as a second one would
                break
        if not stack.stop(force) or force.is_set():
            exit_code = 1
    return exit_code
