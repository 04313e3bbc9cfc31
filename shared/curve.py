"""CURVE keys for the ZMQ plane: generate them, load them, check who may connect.

With ``--curve-keys DIR`` every ZMQ link of the stack is encrypted and authenticated
(RELIABILITY.md, the ZMQ plane 7). The binding end of a link (the scheduler's three
sockets, a frontend's native API, a bound KV events socket) is a CURVE server with the
server key pair; the connecting end (a worker, a frontend's link to the scheduler, a
``pagoda.client``) is a CURVE client with the client key pair and the server's public
key. A ZAP handler in every binding process lets in only the client public keys of the
allow-list directory, so a peer without one of those keys reads nothing.

The directory, as ``pagoda keys DIR`` writes it (ZeroMQ's certificate format, which
``zmq.auth`` and czmq read):

- ``server.key``: the server public key (every process);
- ``server.key_secret``: the server key pair (binding processes only);
- ``client.key_secret``: the client key pair (connecting processes only);
- ``authorized_clients/*.key``: the client public keys a server lets in (binding
  processes only; ``pagoda keys`` puts ``client.key`` there).

A process reads only the files of its role, so a deployment can hand each role only
what it needs (a Kubernetes Secret per role). Secret files must be readable by their
owner alone (0600 or 0400), and no key is ever taken from the environment or logged.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)

SERVER_PUBLIC = "server.key"
SERVER_SECRET = "server.key_secret"
CLIENT_PUBLIC = "client.key"
CLIENT_SECRET = "client.key_secret"
AUTHORIZED_DIR = "authorized_clients"
# Every bound socket names a ZAP domain, with or without CURVE: libzmq then refuses peers
# that open with a ZMTP 1.0/2.0 greeting (or with bytes that are not ZMTP at all), which it
# would otherwise count as subscribers of an XPUB and send the step stream.
ZAP_DOMAIN = b"pagoda"


class CurveError(ValueError):
    """CURVE asked for but unusable: libzmq without it, a missing or exposed key file."""


def require_curve_support() -> None:
    if not zmq.has("curve"):
        raise CurveError(f"CURVE was asked for, but this libzmq ({zmq.zmq_version()}) was built "
                         "without it; install a pyzmq wheel with libsodium/tweetnacl support")


def _write(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _certificate(public: bytes, secret: bytes | None) -> str:
    lines = ["#   ZeroMQ CURVE certificate written by `pagoda keys`", "metadata", "curve",
             f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def generate_keys(directory: str | Path) -> Path:
    """Write a fresh server and client key pair and an allow-list holding the client key.

    Refuses to overwrite: an existing key file is an error (keys are replaced by hand).
    """
    require_curve_support()
    root = Path(directory)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    (root / AUTHORIZED_DIR).mkdir(mode=0o700, exist_ok=True)
    for name in (SERVER_PUBLIC, SERVER_SECRET, CLIENT_PUBLIC, CLIENT_SECRET):
        if (root / name).exists():
            raise CurveError(f"{root / name} exists; remove the old keys first")
    for role in ("server", "client"):
        public, secret = zmq.curve_keypair()
        _write(root / f"{role}.key", _certificate(public, None), 0o644)
        _write(root / f"{role}.key_secret", _certificate(public, secret), 0o600)
        if role == "client":
            allowed = root / AUTHORIZED_DIR / CLIENT_PUBLIC
            allowed.unlink(missing_ok=True)
            _write(allowed, _certificate(public, None), 0o644)
    return root


def _check_private(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CurveError(f"{path}: a secret key file must be readable by its owner alone "
                         f"(mode {stat.S_IMODE(mode):o}); chmod 600 it")


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise CurveError(f"{path}: no such key file")
    if secret:
        _check_private(path)
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as e:
        raise CurveError(f"{path}: not a ZeroMQ certificate ({e})") from None
    if secret and secret_key is None:
        raise CurveError(f"{path}: holds no secret key")
    return public, secret_key


@dataclass(frozen=True)
class CurveKeys:
    """The key files of one directory; each role reads what it needs, when it needs it."""

    directory: Path
    server_public: bytes = field(repr=False)

    @classmethod
    def load(cls, directory: str | Path) -> CurveKeys:
        require_curve_support()
        root = Path(directory).expanduser()
        if not root.is_dir():
            raise CurveError(f"{root}: no such CURVE keys directory (make one: pagoda keys DIR)")
        public, _ = _load(root / SERVER_PUBLIC, secret=False)
        return cls(root, public)

    def server_pair(self) -> tuple[bytes, bytes]:
        public, secret = _load(self.directory / SERVER_SECRET, secret=True)
        if public != self.server_public:
            raise CurveError(f"{self.directory}: {SERVER_SECRET} does not match {SERVER_PUBLIC}")
        assert secret is not None
        return public, secret

    def client_pair(self) -> tuple[bytes, bytes]:
        public, secret = _load(self.directory / CLIENT_SECRET, secret=True)
        assert secret is not None
        return public, secret

    def authorized_clients(self) -> frozenset[bytes]:
        """The allow-list; refused when empty (a server no client may reach is a mistake)."""
        folder = self.directory / AUTHORIZED_DIR
        if not folder.is_dir():
            raise CurveError(f"{folder}: no allow-list directory of client public keys")
        keys = frozenset(_load(p, secret=False)[0] for p in sorted(folder.glob("*.key")))
        if not keys:
            raise CurveError(f"{folder}: holds no client public key (*.key)")
        return keys

    def secure_server(self, sock: zmq.Socket[Any]) -> None:
        public, secret = self.server_pair()
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)

    def secure_client(self, sock: zmq.Socket[Any]) -> None:
        public, secret = self.client_pair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


class _AllowList:
    """The ZAP credentials check: a client public key in the allow-list, counted."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.refused += 1
        log.warning("CURVE: refused a peer whose client key is not in the allow-list "
                    "(%d refused so far)", self.refused)
        return False


class ZapAuthenticator:
    """The ZAP handler of one process's ZMQ context: lets in the allow-listed client keys.

    Started before the process binds any CURVE socket (a handshake that finds no handler
    would not be checked), stopped before the context terminates.
    """

    def __init__(self, ctx: zmq.Context[Any], keys: CurveKeys) -> None:
        self.allow = _AllowList(keys.authorized_clients())
        # the handler runs in its own thread with plain sockets, on the same libzmq context
        # (the ZAP endpoint is per context), also when the process's context is asyncio
        self._auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying), log=log)
        self._auth.start()
        self._auth.configure_curve_callback(domain=ZAP_DOMAIN.decode(),
                                            credentials_provider=self.allow)

    @property
    def refused(self) -> int:
        return self.allow.refused

    def stop(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._auth.stop()


def start_authenticator(ctx: zmq.Context[Any], keys: CurveKeys | None) -> ZapAuthenticator | None:
    """A running ZapAuthenticator for ``ctx`` when CURVE is on, else None."""
    return None if keys is None else ZapAuthenticator(ctx, keys)
