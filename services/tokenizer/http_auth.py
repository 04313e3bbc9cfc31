"""The HTTP API's key check (``--api-key`` / ``PAGODA_API_KEY``, ``--api-key-file``), as
vLLM's server does it, and its CORS settings.

Every request must carry a key as ``Authorization: Bearer <key>`` (what the ``openai``
client sends) or ``x-api-key: <key>`` (what the ``anthropic`` client sends); others get a
401 before any route runs, with OpenAI's error body (Anthropic's under
``/v1/messages``). The paths of ``--api-key-open-paths`` need none: by default
``/health``, ``/metrics``, ``/tokenize`` and ``/detokenize``, as vLLM leaves them open, so
probes and scrapers need no secret; CORS preflights (OPTIONS) need none either. Keys are compared in constant time. ``api_keys``
gathers them: ``--api-key`` (one or more, comma-separated) and the lines of
``--api-key-file``, which must not be readable by group or others (a start with such a
file is refused, naming it).
"""

from __future__ import annotations

import hmac
import json
import os
import stat

from starlette.types import ASGIApp, Receive, Scope, Send


def api_keys(api_key: str | None, api_key_file: str | None) -> list[str]:
    """Every accepted key (empty: no check); ValueError for a key file others can read."""
    keys = [k.strip() for k in (api_key or "").split(",") if k.strip()]
    if api_key_file:
        mode = os.stat(api_key_file).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"api_key_file {api_key_file}: readable by group or others "
                             f"(mode {stat.S_IMODE(mode):o}); chmod 600 it")
        with open(api_key_file, encoding="utf-8") as f:
            keys += [line.strip() for line in f if line.strip() and not line.startswith("#")]
    return keys


class ApiKeyMiddleware:
    """A pure ASGI middleware (no body buffering, streaming answers untouched)."""

    def __init__(self, app: ASGIApp, keys: list[str],
                 open_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self._keys = [k.encode() for k in keys]
        self._open = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].rstrip("/") in self._open or \
                scope["method"] == "OPTIONS" or self._authorised(scope):
            await self.app(scope, receive, send)
            return
        message = "a valid API key is required (Authorization: Bearer <key> or x-api-key: <key>)"
        if scope["path"].startswith("/v1/messages"):  # Anthropic's error shape there
            error: dict[str, object] = {"type": "error", "error": {
                "type": "authentication_error", "message": message}}
        else:
            error = {"error": {"message": message, "type": "authentication_error", "param": None,
                               "code": "invalid_api_key"}}
        body = json.dumps(error).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _authorised(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                if self._known(value[7:].strip()):
                    return True
            elif name == b"x-api-key" and self._known(value.strip()):
                return True
        return False

    def _known(self, given: bytes) -> bool:
        # every key compared, each in constant time: which one matched does not show
        return sum(hmac.compare_digest(given, key) for key in self._keys) > 0
