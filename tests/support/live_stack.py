"""A live `pagoda serve` (the real CLI, all processes) for the e2e tests.

The stack runs in float32 with PAGODA_TESTING=1 (a broken block-accounting invariant is fatal in
the scheduler). Its output goes to a log file; tests poll that file for lines with a
deadline instead of sleeping.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parents[2]


@dataclass
class LiveStack:
    proc: subprocess.Popen[bytes]
    log_path: Path
    frontends: list[str] = field(default_factory=list)
    scheduler: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)
    http: str = ""  # the HTTP API's base URL (".../v1"), as the launcher prints it

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, predicate: Callable[[str], bool], timeout: float = 120.0, after: int = 0) -> str:
        """Poll the log (from offset ``after``) until predicate(text) holds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log()[after:]
            if predicate(text):
                return text
            if self.proc.poll() is not None:
                raise AssertionError(f"pagoda serve exited {self.proc.returncode}:\n{self.log()[-3000:]}")
            time.sleep(0.05)  # polling an observable condition, not synchronising
        raise AssertionError(f"timed out waiting for the log:\n{self.log()[-3000:]}")

    def run_dir(self) -> Path:
        return Path(self.frontends[0][len("ipc://"):]).parent


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_stack(model_dir: Path, log_path: Path, num_frontends: int, *extra: str,
                http_port: int | None = None) -> LiveStack:
    """``pagoda serve``; every frontend serves HTTP on ``http_port`` (default: a free one,
    so stacks never share the default port 8000)."""
    # fp32: the e2e tests compare the stack's tokens with the offline engine's, exactly,
    # and bf16 rounding depends on the batch a request happened to run in
    env = {**os.environ, "PAGODA_TESTING": "1", "PYTHONUNBUFFERED": "1", "PAGODA_DTYPE": "float32"}
    port = free_port() if http_port is None else http_port
    with open(log_path, "wb") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(model_dir),
             "--frontends", str(num_frontends), "--http-port", str(port), *extra],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO,
        )
    stack = LiveStack(proc, log_path)
    text = stack.wait_for_log(lambda t: f"frontend {num_frontends - 1} native API: " in t, timeout=300)
    stack.frontends = re.findall(r"frontend \d+ native API: (\S+)", text)
    m = re.search(r"HTTP API: (\S+)", text)
    assert m, text
    stack.http = m.group(1)
    m = re.search(r"scheduler: frontends (\S+), steps (\S+), results (\S+)", text)
    assert m, text
    stack.scheduler = {"frontend": m.group(1), "step": m.group(2), "result": m.group(3)}
    stack.pids = {k: int(v) for k, v in re.findall(r"(\S+)=(\d+)", text.split("processes:")[1].splitlines()[0])}
    return stack


IDLE = re.compile(r"idle: running=(\d+) waiting=(\d+) kv_usage=([0-9.]+) .* invariant_failures=(\d+)")


@contextlib.contextmanager
def serving(model_dir: Path, log_path: Path, num_frontends: int, *extra: str) -> Iterator[LiveStack]:
    """``start_stack`` for a ``with`` block (a module fixture's body); stopped on exit."""
    stack = start_stack(model_dir, log_path, num_frontends, *extra)
    try:
        yield stack
    finally:
        stop_stack(stack)


def openai_client(stack: LiveStack) -> openai.OpenAI:
    """The official client on the stack's HTTP API; no retries, so each call is one request."""
    return openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0, timeout=120)


def served_client(stack: LiveStack) -> openai.OpenAI:
    """``openai_client`` with ``.model`` set to the id the stack serves (its /v1/models)."""
    c = openai_client(stack)
    c.model = c.models.list().data[0].id  # type: ignore[attr-defined]
    return c


def assert_idle_and_clean(stack: LiveStack, after: int) -> None:
    """The scheduler's last idle line since log offset ``after``: nothing running or
    waiting, every KV block back, block accounting intact."""
    text = stack.wait_for_log(lambda t: IDLE.search(t) is not None, after=after)
    m = list(IDLE.finditer(text))[-1]
    got = (int(m.group(1)), int(m.group(2)), float(m.group(3)), int(m.group(4)))
    assert got == (0, 0, 0.0, 0), m.group(0)


def stop_stack(stack: LiveStack) -> None:
    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(timeout=120) == 0, stack.log()[-3000:]


def expected_offline(model_dir: Path, prompts: list, params: list):  # type: ignore[no-untyped-def,type-arg]
    from pagoda import LLM

    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=2048, max_model_len=2048)
    return llm.generate(prompts, params, use_tqdm=False)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def left_running(stack: LiveStack, wait_s: float = 0.0) -> list[str]:
    """The stack's processes still alive, after waiting up to ``wait_s`` for them to go."""
    deadline = time.monotonic() + wait_s
    while any(alive(pid) for pid in stack.pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling other processes' state
    return [name for name, pid in stack.pids.items() if alive(pid)]


def kill_if_running(stack: LiveStack) -> None:
    """A test's ``finally``: the launcher SIGKILLed if it is still up."""
    if stack.proc.poll() is None:
        stack.proc.kill()
        stack.proc.wait()


def assert_stream_failed(events: list[str], code: str = "engine_error") -> None:
    """An SSE stream that ended with an error event of ``code`` and then ``[DONE]``."""
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == code, error
