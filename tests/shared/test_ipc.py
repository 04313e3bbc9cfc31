"""The socket factory on real ZMQ pairs (ipc:// in a private dir, loopback TCP), run dirs,
the XPUB subscriber count and the parent/child ready pipe."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from shared.codec import MAX_FRAME_BYTES, MalformedFrameCounter, encode, safe_decode
from shared.config import Endpoints
from shared.ipc import (
    AddressError,
    ReadyError,
    is_wildcard,
    make_socket,
    private_run_dir,
    wait_for_subscribers,
    wait_ready,
)
from shared.protocol import (
    FRONTEND_TO_SCHEDULER,
    SCHEDULER_TO_FRONTEND,
    SCHEDULER_TO_WORKER,
    AddRequest,
    RequestError,
    StepBatch,
)
from shared.sampling_params import SamplingParams

TIMEOUT_MS = 5_000


@pytest.fixture
def run_dir() -> Iterator[Path]:
    with private_run_dir() as path:  # short path: pytest's tmp_path can exceed 107 bytes
        yield path


def recv(sock: zmq.Socket[Any]) -> list[bytes]:
    assert sock.poll(TIMEOUT_MS, zmq.POLLIN), "nothing arrived"
    return sock.recv_multipart()


def round_trip(ctx: zmq.Context[Any], address: str) -> None:
    """DEALER -> ROUTER request, ROUTER -> DEALER reply, both through the codec."""
    router = make_socket(ctx, zmq.ROUTER, address)
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)  # the port, where it was "*"
    dealer = make_socket(ctx, zmq.DEALER, address, identity=b"frontend-0")
    counter = MalformedFrameCounter()
    request = AddRequest("r1", [1, 2, 3], SamplingParams(temperature=0), 1.0)
    dealer.send(encode(request))
    frames = recv(router)
    assert frames[0] == b"frontend-0"
    assert safe_decode(frames, FRONTEND_TO_SCHEDULER, counter, num_frames=2) == request
    router.send_multipart([frames[0], encode(RequestError("r1", "too_long", "no"))])
    reply = safe_decode(recv(dealer), SCHEDULER_TO_FRONTEND, counter)
    assert reply == RequestError("r1", "too_long", "no")
    assert counter.count() == 0
    for sock in (router, dealer):
        assert sock.getsockopt(zmq.MAXMSGSIZE) == MAX_FRAME_BYTES
        assert sock.getsockopt(zmq.SNDHWM) > 0 and sock.getsockopt(zmq.RCVHWM) > 0
    dealer.close()
    router.close()


def test_round_trip_over_ipc(ctx: zmq.Context[Any], run_dir: Path) -> None:
    address = Endpoints.local(run_dir).scheduler_frontend
    round_trip(ctx, address)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700


def test_round_trip_over_loopback_tcp(ctx: zmq.Context[Any]) -> None:
    round_trip(ctx, "tcp://127.0.0.1:*")  # the OS picks a free port


def test_router_mandatory_reports_an_unknown_peer(ctx: zmq.Context[Any], run_dir: Path) -> None:
    router = make_socket(ctx, zmq.ROUTER, f"ipc://{run_dir / 'r.sock'}")
    with pytest.raises(zmq.ZMQError) as info:  # not a silent drop
        router.send_multipart([b"gone-frontend", b"x"])
    assert info.value.errno == zmq.EHOSTUNREACH
    router.close()


@pytest.mark.parametrize(
    "address", ["tcp://*:5999", "tcp://0.0.0.0:5999", "tcp://[::]:5999", "tcp://[::0]:5999"]
)
def test_wildcard_bind_is_refused_unless_allowed(ctx: zmq.Context[Any], address: str) -> None:
    assert is_wildcard(address)
    with pytest.raises(AddressError, match="wildcard"):
        make_socket(ctx, zmq.ROUTER, address)
    # connecting to it is not a bind, so it is not refused
    assert not is_wildcard("tcp://127.0.0.1:5999") and not is_wildcard("ipc:///tmp/x")


def test_wildcard_bind_when_allowed(ctx: zmq.Context[Any]) -> None:
    sock = make_socket(ctx, zmq.PULL, "tcp://0.0.0.0:*", allow_wildcard=True)
    assert sock.getsockopt_string(zmq.LAST_ENDPOINT).startswith("tcp://0.0.0.0:")
    sock.close()


def test_bad_addresses_are_refused(ctx: zmq.Context[Any]) -> None:
    with pytest.raises(AddressError):
        make_socket(ctx, zmq.ROUTER, "http://127.0.0.1:80")
    with pytest.raises(AddressError, match="107"):
        make_socket(ctx, zmq.ROUTER, "ipc:///" + "x" * 200)
    with pytest.raises(ValueError, match="bind"):
        make_socket(ctx, zmq.PAIR, "inproc://pair")  # no default role


def test_step_fan_out_reaches_every_rank(ctx: zmq.Context[Any], run_dir: Path) -> None:
    """XPUB -> SUB: every rank gets the same step once all have subscribed."""
    endpoints = Endpoints.local(run_dir)
    xpub = make_socket(ctx, zmq.XPUB, endpoints.scheduler_step)
    ranks = [make_socket(ctx, zmq.SUB, endpoints.scheduler_step) for _ in range(3)]
    assert wait_for_subscribers(xpub, 3, timeout_s=5.0) == 3
    xpub.send(encode(StepBatch(0)))
    counter = MalformedFrameCounter()
    for sub in ranks:
        assert safe_decode(recv(sub), SCHEDULER_TO_WORKER, counter) == StepBatch(0)
        sub.close()
    xpub.close()


def test_wait_for_subscribers_gives_up_at_the_deadline(ctx: zmq.Context[Any], run_dir: Path) -> None:
    xpub = make_socket(ctx, zmq.XPUB, f"ipc://{run_dir / 's.sock'}")
    assert wait_for_subscribers(xpub, 1, timeout_s=0.05) == 0
    xpub.close()


def test_private_run_dir_is_0700_and_removed() -> None:
    with private_run_dir() as path:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        (path / "scheduler.sock").write_bytes(b"")
    assert not path.exists()


def test_ready_handshake_through_a_pipe() -> None:
    read_fd, write_fd = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            from shared.ipc import report_ready
            report_ready({write_fd}, role="scheduler", address="ipc:///x")
        """)],
        pass_fds=(write_fd,), cwd=Path(__file__).parents[2],
    )
    os.close(write_fd)
    info = wait_ready(read_fd, timeout_s=30.0, is_alive=lambda: child.poll() is None)
    assert info["role"] == "scheduler" and info["address"] == "ipc:///x"
    assert info["pid"] == child.pid
    assert child.wait(timeout=30) == 0


def test_ready_handshake_reports_a_child_that_died() -> None:
    read_fd, write_fd = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], pass_fds=(write_fd,))
    os.close(write_fd)
    with pytest.raises(ReadyError, match="exited"):
        wait_ready(read_fd, timeout_s=30.0, is_alive=lambda: child.poll() is None)
    assert child.wait(timeout=30) == 3


def test_ready_handshake_times_out() -> None:
    read_fd, write_fd = os.pipe()
    with pytest.raises(ReadyError, match="within"):
        wait_ready(read_fd, timeout_s=0.05)
    os.close(write_fd)


def test_usable_cpus_follows_the_affinity_not_the_host() -> None:
    """A process pinned to one CPU (a container's cpuset) counts one, as the thread split
    of tensor-parallel ranks must."""
    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from shared.ipc import usable_cpus; print(usable_cpus())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parents[2])
    assert out.stdout.strip() == "1"


@pytest.mark.skipif(not hasattr(os, "nice"), reason="no os.nice")
def test_lower_cpu_priority_is_the_calling_threads_own() -> None:
    """In a thread: that thread's nice value rises, the process's main thread keeps its
    own (what the bench's client thread relies on)."""
    import threading

    from shared.ipc import lower_cpu_priority

    main_before = os.getpriority(os.PRIO_PROCESS, 0)
    seen: dict[str, int] = {}

    def body() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        lower_cpu_priority(5)
        seen["delta"] = os.getpriority(os.PRIO_PROCESS, tid) - before
        lower_cpu_priority(0)  # no-op
        seen["again"] = os.getpriority(os.PRIO_PROCESS, tid) - before

    t = threading.Thread(target=body)
    t.start()
    t.join()
    expected = min(19, main_before + 5) - main_before
    assert seen == {"delta": expected, "again": expected}
    assert os.getpriority(os.PRIO_PROCESS, 0) == main_before
