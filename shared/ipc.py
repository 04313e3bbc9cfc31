"""ZMQ sockets and process start-up for every pagoda process.

``make_socket`` is the only way a process opens a ZMQ socket: it fixes bind or connect
by the socket's role, sets explicit high-water marks, ``MAXMSGSIZE`` (a peer that sends
a bigger frame is disconnected before we read it), ``LINGER`` (bounded, so shutdown never
hangs on a vanished peer), ``ROUTER_MANDATORY`` (a reply to a vanished peer is an error,
not a silent drop), ``XPUB_NODROP`` and ZMTP heartbeats; it refuses a wildcard TCP bind
unless explicitly allowed (RELIABILITY.md, the ZMQ plane 5 and 6).

``private_run_dir`` makes the 0700 directory that holds the ``ipc://`` socket files of
the local stack and removes it afterwards. ``wait_for_subscribers`` is the step link's
half of the worker handshake. ``report_ready`` / ``wait_ready`` let a child process
tell its parent it is serving, through an inherited pipe.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import logging
import os
import select
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import zmq

from shared.codec import MAX_FRAME_BYTES
from shared.curve import ZAP_DOMAIN, CurveKeys

log = logging.getLogger(__name__)

DEFAULT_HWM = 10_000  # messages per peer pipe; far above what one step keeps in flight
DEFAULT_LINGER_MS = 1_000  # long enough to flush final outputs, short enough to exit
DEFAULT_HEARTBEAT_MS = 1_000  # ZMTP ping interval; a silent peer is dropped after 3x
# Unix socket paths are limited to sizeof(sun_path) - 1 bytes (107 on Linux)
MAX_IPC_PATH_BYTES = 107

# Which side binds, by socket type: the long-lived, single end binds (the scheduler's
# ROUTER/XPUB/PULL, a frontend's ROUTER); the many ends connect.
_BINDS_BY_DEFAULT = {zmq.ROUTER, zmq.PUB, zmq.XPUB, zmq.PULL, zmq.REP}
_CONNECTS_BY_DEFAULT = {zmq.DEALER, zmq.SUB, zmq.XSUB, zmq.PUSH, zmq.REQ}


class AddressError(ValueError):
    """An endpoint that is malformed or not allowed (a wildcard bind, a long ipc path)."""


def parse_tcp_host(address: str) -> str | None:
    """The host part of a ``tcp://host:port`` address, None for other transports."""
    if not address.startswith("tcp://"):
        return None
    rest = address[len("tcp://"):]
    host, sep, port = rest.rpartition(":")
    if not sep or not port:
        raise AddressError(f"{address!r}: expected tcp://host:port")
    return host.strip("[]")


def is_wildcard(address: str) -> bool:
    """True for a TCP address that binds every interface (``*``, ``0.0.0.0``, ``::``)."""
    host = parse_tcp_host(address)
    if host is None:
        return False
    if host == "*":
        return True
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False  # a host name or an interface name binds that one interface


def is_exposed(address: str) -> bool:
    """True for a TCP address other hosts may reach: a wildcard, or any host that is not
    loopback (a host name other than ``localhost`` counts as exposed)."""
    host = parse_tcp_host(address)
    if host is None:
        return False
    if host in ("*", "localhost"):
        return host == "*"
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def check_address(address: str) -> None:
    """Raise AddressError unless ``address`` is a usable tcp://, ipc:// or inproc:// one."""
    if address.startswith("tcp://"):
        parse_tcp_host(address)
    elif address.startswith("ipc://"):
        path = address[len("ipc://"):]
        if not path:
            raise AddressError(f"{address!r}: empty ipc path")
        if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
            raise AddressError(
                f"{address!r}: ipc path is over {MAX_IPC_PATH_BYTES} bytes; use a shorter run dir"
            )
    elif not address.startswith("inproc://"):
        raise AddressError(f"{address!r}: expected tcp://, ipc:// or inproc://")


def make_socket(
    ctx: zmq.Context[Any],
    socket_type: int,
    address: str,
    bind: bool | None = None,
    *,
    identity: bytes | None = None,
    sndhwm: int = DEFAULT_HWM,
    rcvhwm: int = DEFAULT_HWM,
    max_msg_size: int = MAX_FRAME_BYTES,
    linger_ms: int = DEFAULT_LINGER_MS,
    heartbeat_ms: int | None = DEFAULT_HEARTBEAT_MS,
    allow_wildcard: bool = False,
    curve: CurveKeys | None = None,
) -> zmq.Socket[Any]:
    """A configured socket, bound or connected to ``address``.

    ``bind=None`` takes the role from the socket type (ROUTER, PUB, XPUB, PULL, REP
    bind; DEALER, SUB, XSUB, PUSH, REQ connect). A SUB subscribes to everything. On
    error the socket is closed before the exception leaves.
    """
    if bind is None:
        if socket_type in _BINDS_BY_DEFAULT:
            bind = True
        elif socket_type in _CONNECTS_BY_DEFAULT:
            bind = False
        else:
            raise ValueError(f"socket type {socket_type}: say bind=True or bind=False")
    check_address(address)
    if bind and curve is None and is_exposed(address) and not allow_wildcard:
        raise AddressError(
            f"refusing to bind {address}: a wildcard or non-loopback bind exposes the ZMQ "
            "plane to other hosts without authentication; give CURVE keys (--curve-keys), "
            "bind 127.0.0.1 or an ipc:// path, or allow it explicitly "
            "(PAGODA_ALLOW_WILDCARD_BIND=1) on an isolated network"
        )
    sock = ctx.socket(socket_type)
    try:
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
        sock.setsockopt(zmq.LINGER, linger_ms)
        if heartbeat_ms:
            sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * heartbeat_ms)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if socket_type == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        elif socket_type == zmq.XPUB:
            # a full pipe makes send fail (EAGAIN) instead of dropping a step delta, and
            # every subscription reaches us, so the scheduler can count its workers
            sock.setsockopt(zmq.XPUB_NODROP, 1)
            sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        elif socket_type == zmq.SUB:
            sock.setsockopt(zmq.SUBSCRIBE, b"")
        if bind:
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
            if curve is not None:
                curve.secure_server(sock)
            if address.startswith("ipc://"):
                _warn_if_shared_dir(Path(address[len("ipc://"):]).parent)
            sock.bind(address)
        else:
            if curve is not None:
                curve.secure_client(sock)
            sock.connect(address)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def _warn_if_shared_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        if directory.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("ipc socket directory %s is accessible to other users", directory)


def wait_for_subscribers(xpub: zmq.Socket[Any], count: int, timeout_s: float) -> int:
    """Block until ``count`` subscriptions arrived on an XPUB; returns how many did.

    A SUB's subscription reaches the publisher some time after it connects, and a step
    published before that is lost to it (ZMQ's slow joiner). The scheduler calls this
    before its first step. Returns early with fewer only at the deadline.
    """
    seen = 0
    deadline = time.monotonic() + timeout_s
    while seen < count:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 or not xpub.poll(remaining_ms, zmq.POLLIN):
            break
        event = xpub.recv()
        if event[:1] == b"\x01":  # subscribe; b"\x00" is an unsubscribe
            seen += 1
    return seen


@contextlib.contextmanager
def private_run_dir(base: str | Path | None = None) -> Iterator[Path]:
    """A fresh 0700 directory for ipc:// socket files, removed with its contents on exit.

    Placed under ``base``, else ``$XDG_RUNTIME_DIR`` (per-user, already private), else
    the temp dir; the path is kept short because ipc paths are limited to 107 bytes.
    """
    if base is None:
        base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = Path(tempfile.mkdtemp(prefix="pagoda-", dir=base))  # mkdtemp creates it 0700
    os.chmod(path, 0o700)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's cpuset, a pinned
    process), not the host's count that ``os.cpu_count`` gives."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """In a child, before exec (``preexec_fn``): SIGTERM when the parent dies, so a
    SIGKILLed launcher leaves no process behind. One prctl call, no lock taken."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: the parent's own teardown still applies
        pass


def lower_cpu_priority(nice: int) -> None:
    """Raise this thread's nice value by ``nice`` (on Linux a thread's own; threads it
    starts later inherit it; in a ``preexec_fn``, before exec, the whole new process's).
    No-op at 0 or where the platform has no ``os.nice``."""
    if nice > 0 and hasattr(os, "nice"):
        os.nice(nice)


# -- ready handshake between a parent and its child process ----------------------------------


class ReadyError(RuntimeError):
    """A child process died or timed out before it reported ready."""


def report_ready(fd: int, **info: str | int) -> None:
    """In the child: tell the parent we serve (``info``: role, addresses...), close ``fd``."""
    payload = json.dumps({"pid": os.getpid(), **info}).encode() + b"\n"
    try:
        os.write(fd, payload)  # well under PIPE_BUF, so one atomic write
    finally:
        os.close(fd)


def wait_ready(
    fd: int, timeout_s: float, is_alive: Callable[[], bool] | None = None
) -> dict[str, str | int]:
    """In the parent: read the child's ready line from the pipe's read end ``fd``.

    Raises ReadyError when the child closes the pipe without a line (it died), when
    ``is_alive()`` turns false, or at the deadline. Closes ``fd``.
    """
    deadline = time.monotonic() + timeout_s
    data = b""
    try:
        while not data.endswith(b"\n"):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ReadyError(f"no ready report within {timeout_s:.0f}s")
            readable, _, _ = select.select([fd], [], [], min(remaining, 0.2))
            if readable:
                chunk = os.read(fd, 4096)
                if not chunk:
                    raise ReadyError("the child exited before it reported ready")
                data += chunk
                if len(data) > 65536:
                    raise ReadyError("ready report too long")
            elif is_alive is not None and not is_alive():
                raise ReadyError("the child exited before it reported ready")
    finally:
        os.close(fd)
    try:
        info = json.loads(data)
    except ValueError:
        raise ReadyError("malformed ready report") from None
    if not isinstance(info, dict) or not all(
        isinstance(k, str) and isinstance(v, (str, int)) for k, v in info.items()
    ):
        raise ReadyError("malformed ready report")
    return info
