"""Runs a real frontend process (``python -m services.tokenizer.main``) for tests.

The frontend talks to a ``FakeScheduler`` (tests/support/fake_scheduler.py) over
ipc:// files in a short private directory; its log goes to a file the tests read
(dropped-frame warnings are its observable counter). Readiness comes through the
``--ready-fd`` pipe, with a deadline.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from shared.ipc import wait_ready
from support.fake_scheduler import FakeScheduler

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class FrontendStack:
    run_dir: Path
    scheduler: FakeScheduler
    proc: subprocess.Popen[bytes]
    native: str  # the frontend's native-API address
    log_path: Path
    http_port: int = 0  # its HTTP API's port on 127.0.0.1

    @property
    def native_path(self) -> Path:
        return Path(self.native[len("ipc://"):])

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.scheduler.stop()
        shutil.rmtree(self.run_dir, ignore_errors=True)
        return self.proc.returncode


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_frontend(model_dir: Path, *, env: dict[str, str] | None = None,
                   startup_timeout_s: float = 60.0) -> FrontendStack:
    # ipc paths are limited to 107 bytes: a short directory under /tmp, 0700 by mkdtemp
    run_dir = Path(tempfile.mkdtemp(prefix="pgfe-", dir="/tmp"))
    scheduler = FakeScheduler(f"ipc://{run_dir}/sched.sock").start()
    native = f"ipc://{run_dir}/fe0.sock"
    http_port = free_port()
    full_env = dict(
        os.environ,
        PAGODA_SCHEDULER_FRONTEND=scheduler.address,
        PAGODA_FRONTEND_NATIVE=native,
        PAGODA_MODEL=str(model_dir),
        # its own free port: SO_REUSEPORT would otherwise share 8000 with other stacks
        PAGODA_HTTP_PORT=str(http_port),
        PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **(env or {}),
    )
    log_path = run_dir / "frontend.log"
    read_fd, write_fd = os.pipe()
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.tokenizer.main", "--ready-fd", str(write_fd)],
            env=full_env, cwd=REPO_ROOT, pass_fds=[write_fd], stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    os.close(write_fd)
    stack = FrontendStack(run_dir, scheduler, proc, native, log_path, http_port)
    try:
        wait_ready(read_fd, startup_timeout_s, lambda: proc.poll() is None)
    except Exception:  # noqa: BLE001 -- any start-up failure: report the log, then fail
        log = stack.log()
        stack.stop()
        raise RuntimeError(f"frontend did not start:\n{log}") from None
    return stack
