"""The frontend's OpenAI-compatible HTTP API: uvicorn serving FastAPI on this loop.

A ``FrontendApi`` beside the native API, on the same ``FrontendCore``. Each frontend
process binds its own listening socket with ``SO_REUSEPORT`` on ``http_host:http_port``,
so several frontends serve one port and the kernel spreads connections over them;
uvicorn gets the bound socket. The routes are ``http_app.py``'s; the generation
requests in flight are ``http_requests.py``'s.

Shutdown (``stop_accepting``): new generation requests and ``/health`` get 503;
``abort_all`` ends in-flight ones with finish_reason "abort"; cancelling ``serve``
closes the listener and lets the answers finish.
"""

from __future__ import annotations

import socket

import uvicorn

from services.tokenizer.frontend_core import FrontendCore
from services.tokenizer.http_app import CorsSettings, build_app
from services.tokenizer.http_auth import api_keys
from services.tokenizer.http_requests import HttpRequests
from services.tokenizer.responses_store import ResponsesStore
from shared.config import ConfigError, PagodaConfig

LISTEN_BACKLOG = 2048
GRACEFUL_CLOSE_S = 5.0  # for open connections to finish once serving stops


def bind_reuseport(host: str, port: int) -> socket.socket:
    """A listening TCP socket other frontends can bind too (``SO_REUSEPORT``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class HttpApi:
    """The HTTP API of one frontend process (a ``FrontendApi``)."""

    def __init__(self, core: FrontendCore, config: PagodaConfig) -> None:
        proc = config.process
        self.requests = HttpRequests(core)
        self.address = f"http://{proc.http_host}:{proc.http_port}"
        if proc.http_host in ("0.0.0.0", "::", "*") and not proc.allow_wildcard_bind:
            raise ConfigError(
                f"refusing to serve HTTP on {proc.http_host}: every interface; use 127.0.0.1 or "
                "allow it explicitly (PAGODA_ALLOW_WILDCARD_BIND=1) behind a firewall or proxy")
        try:
            keys = api_keys(proc.api_key, proc.api_key_file)
        except (OSError, ValueError) as e:
            raise ConfigError(str(e)) from None
        self._sock = bind_reuseport(proc.http_host, proc.http_port)
        store = ResponsesStore(proc.responses_max_stored, proc.responses_ttl_s)
        open_paths = frozenset(x.strip().rstrip("/") for x in proc.api_key_open_paths.split(",")
                               if x.strip())
        app = build_app(self.requests, proc.http_max_body_bytes, store, api_keys=keys,
                        cors=CorsSettings.from_process(proc), open_paths=open_paths)
        self._server = uvicorn.Server(uvicorn.Config(
            app, lifespan="off", log_config=None, access_log=False, ws="none",
            timeout_graceful_shutdown=GRACEFUL_CLOSE_S, server_header=False))

    @property
    def num_inflight(self) -> int:
        return self.requests.num_inflight

    def stop_accepting(self) -> None:
        self.requests.accepting = False

    async def abort_all(self) -> None:
        await self.requests.abort_all()

    async def serve(self) -> None:
        """uvicorn on the bound socket until cancelled (its startup, loop, shutdown
        without ``Server.serve``'s signal handlers: the frontend owns the signals)."""
        server, cfg = self._server, self._server.config
        if not cfg.loaded:
            cfg.load()
        server.lifespan = cfg.lifespan_class(cfg)
        await server.startup(sockets=[self._sock])
        try:
            await server.main_loop()
        finally:
            server.should_exit = True
            await server.shutdown(sockets=[self._sock])

    async def close(self) -> None:
        await self.requests.close()
        self._sock.close()

    def discard(self) -> None:
        """Release the listening socket of an API that will never serve."""
        self._sock.close()
