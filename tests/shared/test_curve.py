"""CURVE on the ZMQ plane (issue 23) on real libzmq sockets: the keys `pagoda keys` writes,
the checks on loading them, who reads a CURVE step stream (an allow-listed client only),
legacy-greeting peers on a plain bound XPUB, and the bind rules with and without CURVE."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from pagoda.cli import main as cli_main
from shared.config import ConfigError, ProcessSettings
from shared.curve import (
    AUTHORIZED_DIR,
    CLIENT_SECRET,
    SERVER_SECRET,
    CurveError,
    CurveKeys,
    ZapAuthenticator,
    generate_keys,
    start_authenticator,
)
from shared.ipc import AddressError, is_exposed, make_socket

TIMEOUT_MS = 3_000


@pytest.fixture
def keys(tmp_path: Path) -> CurveKeys:
    assert cli_main(["keys", str(tmp_path / "keys")]) == 0
    return CurveKeys.load(tmp_path / "keys")


@pytest.fixture
def auth(ctx: zmq.Context[Any], keys: CurveKeys) -> Iterator[ZapAuthenticator]:
    """The ZAP handler of ``ctx``; stopped before ``ctx`` ends (its sockets would keep the
    context's termination waiting)."""
    handler = start_authenticator(ctx, keys)
    assert handler is not None
    yield handler
    handler.stop()


def other_keys(tmp_path: Path, name: str) -> CurveKeys:
    """A second, independent key set (its client key is in no one else's allow-list)."""
    return CurveKeys.load(generate_keys(tmp_path / name))


def client_of(server: CurveKeys, client: CurveKeys, tmp_path: Path) -> CurveKeys:
    """``client``'s client pair, aimed at ``server``'s public key."""
    folder = tmp_path / "mixed"
    folder.mkdir(mode=0o700)
    shutil.copy(server.directory / "server.key", folder / "server.key")
    shutil.copy(client.directory / CLIENT_SECRET, folder / CLIENT_SECRET)
    os.chmod(folder / CLIENT_SECRET, 0o600)
    return CurveKeys.load(folder)


def receives(pub: zmq.Socket[Any], sub: zmq.Socket[Any], wait_ms: int = 1_500) -> bool:
    """Whether ``sub`` gets what ``pub`` publishes within ``wait_ms`` (sent repeatedly, as
    a subscription reaches a publisher some time after the connect)."""
    deadline = time.monotonic() + wait_ms / 1000
    while time.monotonic() < deadline:
        pub.send(b"step", flags=zmq.NOBLOCK)
        if sub.poll(50, zmq.POLLIN):
            return sub.recv() == b"step"
    return False


def test_keys_are_written_private_and_read_back(keys: CurveKeys) -> None:
    root = keys.directory
    for name in (SERVER_SECRET, CLIENT_SECRET):
        assert (root / name).stat().st_mode & 0o777 == 0o600
    server_public, _ = keys.server_pair()
    assert server_public == keys.server_public and len(server_public) == 40
    client_public, _ = keys.client_pair()
    assert keys.authorized_clients() == frozenset({client_public})
    assert client_public != server_public
    with pytest.raises(CurveError, match="exists"):
        generate_keys(root)  # never overwritten


def test_key_file_checks_name_the_file(keys: CurveKeys, tmp_path: Path) -> None:
    root = keys.directory
    os.chmod(root / SERVER_SECRET, 0o644)
    with pytest.raises(CurveError, match=r"server.key_secret.*owner alone.*644"):
        keys.server_pair()
    os.chmod(root / SERVER_SECRET, 0o400)  # a Kubernetes secret mount's mode is fine
    keys.server_pair()
    (root / CLIENT_SECRET).unlink()
    with pytest.raises(CurveError, match="client.key_secret: no such key file"):
        keys.client_pair()
    for key in (root / AUTHORIZED_DIR).iterdir():
        key.unlink()
    with pytest.raises(CurveError, match="no client public key"):
        keys.authorized_clients()
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "server.key").write_text("not a certificate\n")
    with pytest.raises(CurveError, match="server.key"):
        CurveKeys.load(tmp_path / "bad")
    with pytest.raises(CurveError, match="no such CURVE keys directory"):
        CurveKeys.load(tmp_path / "missing")


def test_a_mismatched_server_pair_is_refused(keys: CurveKeys, tmp_path: Path) -> None:
    other = other_keys(tmp_path, "other")
    shutil.copy(other.directory / SERVER_SECRET, keys.directory / SERVER_SECRET)
    with pytest.raises(CurveError, match="does not match"):
        keys.server_pair()


def test_curve_asked_for_without_libzmq_support_refuses_to_start(
        monkeypatch: pytest.MonkeyPatch, keys: CurveKeys) -> None:
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(ConfigError, match="built without it"):
        ProcessSettings(curve_keys=str(keys.directory))
    with pytest.raises(CurveError, match="built without it"):
        CurveKeys.load(keys.directory)


def test_settings_load_the_keys_or_say_which_file_is_wrong(keys: CurveKeys, tmp_path: Path) -> None:
    assert ProcessSettings().load_curve_keys() is None
    assert ProcessSettings(curve_keys=str(keys.directory)).load_curve_keys() == keys
    with pytest.raises(ConfigError, match="curve_keys: .*no such CURVE keys directory"):
        ProcessSettings(curve_keys=str(tmp_path / "nowhere")).load_curve_keys()


def test_only_an_allow_listed_client_reads_a_curve_step_stream(
        ctx: zmq.Context[Any], keys: CurveKeys, auth: ZapAuthenticator, tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/steps.sock"
    pub = make_socket(ctx, zmq.XPUB, address, curve=keys)
    allowed = make_socket(ctx, zmq.SUB, address, curve=keys)
    assert receives(pub, allowed)
    stranger = make_socket(ctx, zmq.SUB, address,
                           curve=client_of(keys, other_keys(tmp_path, "stranger"), tmp_path))
    plain = make_socket(ctx, zmq.SUB, address)  # no CURVE at all
    assert not receives(pub, stranger) and not receives(pub, plain)
    assert auth.refused >= 1  # the stranger's key reached the ZAP handler and was refused
    assert receives(pub, allowed)  # and the allowed one still reads


def test_a_client_with_the_wrong_server_key_reads_nothing(
        ctx: zmq.Context[Any], keys: CurveKeys, auth: ZapAuthenticator, tmp_path: Path) -> None:
    impostor_view = other_keys(tmp_path, "impostor")  # expects another server's public key
    address = f"ipc://{tmp_path}/steps.sock"
    pub = make_socket(ctx, zmq.XPUB, address, curve=keys)
    sub = make_socket(ctx, zmq.SUB, address, curve=impostor_view)
    assert not receives(pub, sub)


@pytest.mark.parametrize("opening", [
    b"\x01\x00",  # a ZMTP 1.0 greeting: an empty identity frame
    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # a TLS client hello
])
def test_a_legacy_or_foreign_peer_reads_nothing_from_a_plain_xpub(
        ctx: zmq.Context[Any], opening: bytes) -> None:
    """Without CURVE too, as in the default local stack: every bound socket names a ZAP
    domain, so libzmq drops a peer that does not open with a ZMTP 3 greeting instead of
    taking it as a subscriber that gets the step stream."""
    pub = make_socket(ctx, zmq.XPUB, "tcp://127.0.0.1:*")
    port = int(pub.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
    peer = socket.create_connection(("127.0.0.1", port), timeout=2)
    try:
        peer.sendall(opening)
        assert not pub.poll(500, zmq.POLLIN)  # no subscription event from it
        for _ in range(5):
            pub.send(b"SECRET-STEP", flags=zmq.NOBLOCK)
        received = b""
        peer.settimeout(0.5)
        try:
            while chunk := peer.recv(4096):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        assert b"SECRET-STEP" not in received
        # a real subscriber still does
        sub = make_socket(ctx, zmq.SUB, f"tcp://127.0.0.1:{port}")
        assert pub.poll(TIMEOUT_MS, zmq.POLLIN) and pub.recv() == b"\x01"
        assert receives(pub, sub)
        sub.close(linger=0)
    finally:
        peer.close()
        pub.close(linger=0)


@pytest.mark.parametrize(("address", "exposed"), [
    ("tcp://*:5999", True), ("tcp://0.0.0.0:5999", True), ("tcp://[::]:5999", True),
    ("tcp://10.1.2.3:5999", True), ("tcp://scheduler:5999", True),
    ("tcp://127.0.0.1:5999", False), ("tcp://[::1]:5999", False), ("tcp://localhost:5999", False),
    ("ipc:///tmp/x.sock", False), ("inproc://x", False),
])
def test_which_binds_are_exposed(address: str, exposed: bool) -> None:
    assert is_exposed(address) is exposed


def test_an_exposed_bind_needs_curve_or_an_explicit_allowance(
        ctx: zmq.Context[Any], keys: CurveKeys, auth: ZapAuthenticator) -> None:
    with pytest.raises(AddressError, match="non-loopback.*--curve-keys"):
        make_socket(ctx, zmq.ROUTER, "tcp://0.0.0.0:*")
    make_socket(ctx, zmq.ROUTER, "tcp://0.0.0.0:*", curve=keys).close(linger=0)
    make_socket(ctx, zmq.ROUTER, "tcp://0.0.0.0:*", allow_wildcard=True).close(linger=0)
