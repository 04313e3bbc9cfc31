"""pagoda.client against a real frontend process and a fake scheduler.

Covers what the frontend tests do not: the client's own checks (before anything is
sent), grouping of n samples, the asyncio client with concurrent requests and early
close, several client processes at once, timeouts without a frontend, and that the
module imports without torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from pagoda.client import (
    AsyncClient,
    Client,
    InvalidRequestError,
    RequestTimeoutError,
)
from shared.codec import decode
from shared.protocol import AddRequest, GenerateRequest
from support.fake_scheduler import Script
from support.frontend_proc import REPO_ROOT, FrontendStack, start_frontend


def _echo(add: AddRequest) -> Script:
    """Sample i answers the prompt's ids shifted by 100 * i, two tokens a step."""
    ids = add.prompt_token_ids
    return Script([[t + 100 * i for t in ids] for i in range(add.sampling_params.n)],
                  tokens_per_step=2)


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path) -> Iterator[FrontendStack]:
    s = start_frontend(smollm2_dir)
    s.scheduler.script_for = _echo
    yield s
    assert s.stop() == 0, s.log()


def test_imports_without_torch() -> None:
    code = "import sys, pagoda.client; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True,
                   env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))


@pytest.mark.parametrize("kwargs", [
    {"prompt": "hi", "temperature": -1.0},
    {"prompt": "hi", "n": 0},
    {"prompt": "hi", "not_a_param": 1},
    {"prompt": [1, -2]},
    {"prompt": None},
    {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "user"}]},
])
def test_client_side_errors_raise_before_sending(kwargs: dict) -> None:
    # no frontend listens at this address: anything sent would only time out
    with Client("ipc:///tmp/pagoda-no-such-frontend.sock", timeout=5) as c, \
            pytest.raises(InvalidRequestError):
        c.generate(**kwargs)


def test_timeout_without_a_frontend() -> None:
    with tempfile.TemporaryDirectory(dir="/tmp") as d, Client(f"ipc://{d}/none.sock") as c, \
            pytest.raises(RequestTimeoutError):
        c.generate([1, 2, 3], timeout=0.2)


def test_generate_groups_n_samples_with_usage(stack: FrontendStack) -> None:
    with Client(stack.native, timeout=20) as c:
        result = c.generate([5, 6, 7], n=3, max_tokens=8)
    assert [o.index for o in result.outputs] == [0, 1, 2]
    assert [o.token_ids for o in result.outputs] == [[5, 6, 7], [105, 106, 107], [205, 206, 207]]
    assert all(o.finish_reason == "length" for o in result.outputs)
    assert result.usage.prompt_tokens == 3 and result.usage.completion_tokens == 9


def test_one_client_interleaves_two_streams(stack: FrontendStack) -> None:
    with Client(stack.native, timeout=20) as c:
        a = c.stream([10, 11, 12, 13], max_tokens=8)
        b = c.stream([20, 21, 22, 23], max_tokens=8)
        got_a, got_b = [], []
        for da, db in zip(a, b):
            got_a += da.token_ids
            got_b += db.token_ids
    assert got_a == [10, 11, 12, 13] and got_b == [20, 21, 22, 23]


def test_async_client_concurrent_requests_and_early_close(stack: FrontendStack) -> None:
    async def run() -> None:
        async with AsyncClient(stack.native, timeout=20) as c:
            prompts = [[30 + i, 31 + i, 32 + i] for i in range(16)]
            results = await asyncio.gather(*(c.generate(p, max_tokens=8) for p in prompts))
            assert [r.outputs[0].token_ids for r in results] == prompts
            deltas = [d async for d in c.stream([50, 51, 52, 53, 54], max_tokens=8)]
            assert [t for d in deltas for t in d.token_ids] == [50, 51, 52, 53, 54]
            stack.scheduler.script_for = lambda add: Script([[65]], forever=True)
            try:
                async with c.stream([60, 61], max_tokens=50) as s:
                    async for _ in s:
                        break
            finally:
                stack.scheduler.script_for = _echo
            add = stack.scheduler.add_for([60, 61])
            assert add is not None
            assert await asyncio.to_thread(
                stack.scheduler.wait_for, lambda: stack.scheduler.aborted(add.request_id)
            )
            with pytest.raises(RequestTimeoutError):
                stack.scheduler.script_for = lambda add: Script([[65]], forever=True)
                try:
                    await c.generate([70, 71], max_tokens=50, timeout=0.2)
                finally:
                    stack.scheduler.script_for = _echo

    asyncio.run(run())


CLIENT_PROCESS = """
import sys
from pagoda.client import Client
base = int(sys.argv[2])
with Client(sys.argv[1], timeout=60) as c:
    for i in range(10):
        prompt = [base + i, base + i + 1, base + i + 2]
        r = c.generate(prompt, max_tokens=8, n=2)
        assert r.outputs[0].token_ids == prompt, (r, prompt)
        assert r.outputs[1].token_ids == [t + 100 for t in prompt], r
print("ok")
"""


def test_several_client_processes_at_once(stack: FrontendStack) -> None:
    procs = [
        subprocess.Popen([sys.executable, "-c", CLIENT_PROCESS, stack.native, str(1000 * (k + 1))],
                         cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
        for k in range(3)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0 and out.strip().endswith(b"ok"), out.decode()


def test_timeout_when_the_frontend_refuses_the_handshake() -> None:
    """A frontend with CURVE keys refuses a client without them: the socket is left with
    no pipe, where a plain send would wait for ever. Each request, the first and the ones
    after the refusal, ends in a timeout (no answer ever comes). An abort is one frame
    sent, no answer awaited: it times out where the socket has no pipe, and returns where
    it caught one of the pipes each reconnect makes before the handshake fails (a CI run
    under load did); either way it returns by the timeout (run in a thread: a hang fails,
    not stalls)."""
    _, secret = zmq.curve_keypair()
    ctx: zmq.Context = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.CURVE_SERVER, 1)
    server.setsockopt(zmq.CURVE_SECRETKEY, secret)
    server.setsockopt(zmq.LINGER, 0)
    errors: list[BaseException] = []

    def run(address: str) -> None:
        try:
            with Client(address, timeout=0.3) as c:
                for _ in range(3):
                    with pytest.raises(RequestTimeoutError):
                        c.generate([1, 2, 3])
                with contextlib.suppress(RequestTimeoutError):
                    c.abort("gone")

            async def run_async() -> None:
                async with AsyncClient(address, timeout=0.3) as ac:
                    for _ in range(3):
                        with pytest.raises(RequestTimeoutError):
                            await ac.generate([1, 2, 3])
                    with contextlib.suppress(RequestTimeoutError):
                        await ac.abort("gone")

            asyncio.run(run_async())
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)

    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        address = f"ipc://{d}/curve.sock"
        server.bind(address)
        try:
            worker = threading.Thread(target=run, args=(address,), daemon=True)
            worker.start()
            worker.join(30)
            assert not worker.is_alive(), "a request against a refusing frontend hung"
            assert not errors, errors
        finally:
            server.close()
            ctx.term()


class _PipeGoesAtSend:
    """A DEALER whose pipe goes between poll and send, as when a refused handshake drops
    the pipe a reconnect made: the first ``drops`` sends raise Again."""

    def __init__(self, sock: zmq.Socket, drops: int) -> None:
        self._sock = sock
        self.drops = drops

    def send(self, frame: bytes, flags: int = 0) -> None:
        if self.drops > 0:
            self.drops -= 1
            raise zmq.Again()
        self._sock.send(frame, flags=flags)

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


class _NeverTakes:
    """An asyncio DEALER whose send never completes, as one left without a pipe."""

    def __init__(self, sock: object) -> None:
        self._sock = sock
        self.sends = 0

    async def send(self, frame: bytes, flags: int = 0) -> None:
        self.sends += 1
        await asyncio.Event().wait()

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


def test_async_abort_times_out_where_the_socket_takes_no_message() -> None:
    """The async client's abort waits for its socket by the client's timeout and then
    raises RequestTimeoutError (never hangs, never leaks asyncio's TimeoutError)."""
    async def run(address: str) -> None:
        async with AsyncClient(address, timeout=0.2) as ac:
            never = _NeverTakes(ac._sock)
            ac._sock = never  # type: ignore[assignment]
            with pytest.raises(RequestTimeoutError) as caught:
                await asyncio.wait_for(ac.abort("r1"), 10)  # a hang fails here instead
            assert caught.value.request_id == "r1" and never.sends == 1
            ac._sock = never._sock  # type: ignore[assignment]

    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        asyncio.run(run(f"ipc://{d}/nobody.sock"))


def test_a_pipe_lost_between_poll_and_send_is_waited_for_not_raised() -> None:
    """Poll said writable, then the send found no pipe: the client waits for the next
    pipe by the same deadline (the request reaches the frontend), and where none comes,
    the caller gets a RequestTimeoutError, never zmq's Again."""
    ctx: zmq.Context = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        address = f"ipc://{d}/router.sock"
        server.bind(address)
        try:
            with Client(address, timeout=0.5) as c:
                c._sock = _PipeGoesAtSend(c._sock, drops=1)  # type: ignore[assignment]
                with pytest.raises(RequestTimeoutError):
                    c.generate([1, 2, 3], request_id="r1")  # the server never answers
                assert server.poll(2000, zmq.POLLIN)
                _, frame = server.recv_multipart()
                assert isinstance(decode(frame), GenerateRequest)
                assert decode(frame).request_id == "r1"

                c._sock = _PipeGoesAtSend(c._sock._sock, drops=10**9)  # type: ignore[attr-defined]
                with pytest.raises(RequestTimeoutError):
                    c.generate([1, 2, 3], timeout=0.2)
                with pytest.raises(RequestTimeoutError):
                    c.abort("r1")
        finally:
            server.close()
            ctx.term()
