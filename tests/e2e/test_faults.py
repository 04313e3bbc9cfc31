"""Deaths under `pagoda serve` (issue 23): what clients see, how fast, what is left.

The scheduler SIGKILLed mid-stream: its frontends hear nothing more and fail every
request in flight with ``engine_error`` within ``SCHEDULER_SILENCE_S`` (a streamed answer
gets an error event, then ``[DONE]``; a whole one a 500), and the stack goes down with a
non-zero status, no process and no ipc socket file left.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from services.tokenizer.engine_client import SCHEDULER_SILENCE_S
from support.live_stack import (
    assert_stream_failed,
    kill_if_running,
    left_running,
    start_stack,
    stop_stack,
)

pytestmark = pytest.mark.slow
LONG = {"model": "smollm2", "prompt": "Count: one, two, three,", "max_tokens": 900,
        "ignore_eos": True, "temperature": 0}


def test_a_killed_scheduler_fails_requests_fast_and_takes_the_stack_down(
        smollm2_dir: Path, tmp_path: Path) -> None:
    stack = start_stack(smollm2_dir, tmp_path / "serve.log", 1, "--num-kv-blocks", "128",
                        "--max-model-len", "1024")
    run_dir = stack.run_dir()
    try:
        async def run() -> tuple[list[str], httpx.Response, float]:
            async with httpx.AsyncClient(base_url=stack.http, timeout=120) as http, \
                    http.stream("POST", "/completions", json={**LONG, "stream": True}) as r:
                lines = r.aiter_lines()
                assert (await lines.__anext__()).startswith("data: {")
                whole = asyncio.ensure_future(http.post("/completions", json=LONG))
                await asyncio.sleep(0.5)  # the second request reaches the scheduler
                killed = time.monotonic()
                os.kill(stack.pids["scheduler"], signal.SIGKILL)
                events = [line async for line in lines if line]
                answer = await whole
                return events, answer, time.monotonic() - killed

        events, answer, waited = asyncio.run(run())
        assert_stream_failed(events)
        assert answer.status_code == 500 and answer.json()["error"]["code"] == "engine_error"
        assert waited < SCHEDULER_SILENCE_S + 10, waited
        code = stack.proc.wait(timeout=60)
    finally:
        kill_if_running(stack)
    assert code != 0
    assert left_running(stack) == []
    assert not list(run_dir.glob("*.sock")), list(run_dir.iterdir())


def test_a_second_signal_cuts_the_drain_short(smollm2_dir: Path, tmp_path: Path) -> None:
    """SIGTERM starts the drain (in-flight requests may finish, up to 30 s); a second
    SIGTERM ends it: the stream ends with finish_reason "abort" and [DONE], and every
    process is gone within the forced grace, the ipc files with them."""
    stack = start_stack(smollm2_dir, tmp_path / "serve.log", 1, "--num-kv-blocks", "128",
                        "--max-model-len", "1024")
    run_dir = stack.run_dir()
    try:
        async def run() -> tuple[list[str], float]:
            async with httpx.AsyncClient(base_url=stack.http, timeout=120) as http, \
                    http.stream("POST", "/completions", json={**LONG, "stream": True}) as r:
                lines = r.aiter_lines()
                assert (await lines.__anext__()).startswith("data: {")
                stack.proc.send_signal(signal.SIGTERM)
                stack.wait_for_log(lambda t: "draining 1 request(s)" in t)
                second = time.monotonic()
                stack.proc.send_signal(signal.SIGTERM)
                events = [line async for line in lines if line]
                return events, second

        events, second = asyncio.run(run())
        code = stack.proc.wait(timeout=60)
        took = time.monotonic() - second
    finally:
        kill_if_running(stack)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    assert took < 10, took  # not the 30 s drain
    assert code == 1  # a forced stop
    assert left_running(stack) == []
    assert not run_dir.exists() or not list(run_dir.glob("*.sock"))


@pytest.mark.parametrize(("fault", "extra"), [
    ("worker_raise_after=4", ()), ("worker_exit_after=4", ()),
    ("worker_hang_after=4", ("--step-timeout-s", "2")),
    ("worker_drop_after=4", ("--step-timeout-s", "2")),
    ("scheduler_raise_after=4", ()), ("frontend_raise_after=4", ()),
])
def test_faults_in_a_step_fail_requests_fast(fault: str, extra: tuple[str, ...],
                                             smollm2_dir: Path, tmp_path: Path) -> None:
    """A worker that raises in a step, exits, hangs in one or loses its result frame; the
    scheduler's loop thread or a frontend's receive loop dying (fault injection, so the
    moment is a step in flight): the streamed request gets an engine_error event and
    [DONE] within seconds (not the 10 s of scheduler silence), and the stack goes down
    with exit 1, nothing left."""
    stack = start_stack(smollm2_dir, tmp_path / "serve.log", 1, "--num-kv-blocks", "128",
                        "--max-model-len", "1024", "--fault", fault, *extra)
    try:
        async def run() -> tuple[list[str], float]:
            started = time.monotonic()
            async with httpx.AsyncClient(base_url=stack.http, timeout=120) as http, \
                    http.stream("POST", "/completions", json={**LONG, "stream": True}) as r:
                events = [line async for line in r.aiter_lines() if line]
            return events, time.monotonic() - started

        events, took = asyncio.run(run())
        code = stack.proc.wait(timeout=60)
    finally:
        kill_if_running(stack)
    assert_stream_failed(events)
    assert took < (15 if "worker" in fault else SCHEDULER_SILENCE_S), took
    assert code == 1
    assert left_running(stack) == []


def test_a_repeated_result_frame_is_ignored(smollm2_dir: Path, tmp_path: Path) -> None:
    """Rank 0 sends one step's result twice: the scheduler counts the second as stale and
    serves on; the answer is the same as without the fault and the stack stays healthy."""
    prompt = {"model": "smollm2", "prompt": "Count: one, two, three,", "max_tokens": 24,
              "temperature": 0}
    stack = start_stack(smollm2_dir, tmp_path / "serve.log", 1, "--num-kv-blocks", "128",
                        "--max-model-len", "1024", "--fault", "worker_dup_after=3")
    try:
        with httpx.Client(base_url=stack.http, timeout=120) as http:
            first = http.post("/completions", json=prompt).json()  # the duplicate lands here
            second = http.post("/completions", json=prompt).json()
            assert httpx.get(stack.http.removesuffix("/v1") + "/health").status_code == 200
    finally:
        stop_stack(stack)
    assert first["choices"][0]["text"] == second["choices"][0]["text"]
    assert first["usage"]["completion_tokens"] == 24
    assert "stale_step" in stack.log()


def test_a_dead_frontend_takes_the_stack_down(smollm2_dir: Path, tmp_path: Path) -> None:
    """The documented policy: a child that dies takes `pagoda serve` down (compose's or
    Kubernetes' restart policy brings it back). The frontend exits on its second request:
    that request's connection ends without an answer, the stack exits 1 within seconds,
    no process and no ipc file are left."""
    stack = start_stack(smollm2_dir, tmp_path / "serve.log", 1, "--num-kv-blocks", "128",
                        "--max-model-len", "1024", "--fault", "frontend_exit_after=2")
    run_dir = stack.run_dir()
    short = {**LONG, "max_tokens": 4}
    try:
        with httpx.Client(base_url=stack.http, timeout=60) as http:
            assert http.post("/completions", json=short).status_code == 200
            died = time.monotonic()
            with pytest.raises(httpx.TransportError):
                http.post("/completions", json=short)
        code = stack.proc.wait(timeout=60)
        took = time.monotonic() - died
    finally:
        kill_if_running(stack)
    assert code == 1
    assert took < 15, took
    assert left_running(stack) == []
    assert not run_dir.exists() or not list(run_dir.glob("*.sock"))


def test_a_killed_launcher_takes_its_children_with_it(smollm2_dir: Path, tmp_path: Path) -> None:
    """`pagoda serve` SIGKILLed (no chance to stop anything): every child gets SIGTERM from
    the kernel (PR_SET_PDEATHSIG), stops, and removes its socket files."""
    stack = start_stack(smollm2_dir, tmp_path / "serve.log", 1, "--num-kv-blocks", "128",
                        "--max-model-len", "512")
    run_dir = stack.run_dir()
    stack.proc.kill()
    stack.proc.wait()
    assert left_running(stack, wait_s=30) == []
    assert not list(run_dir.glob("*.sock")), list(run_dir.iterdir())
