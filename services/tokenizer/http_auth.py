"""The HTTP API's key check (``--api-key`` / ``PAGODA_API_KEY``), as vLLM's server does it.

Every request under ``/v1`` must carry the key as ``Authorization: Bearer <key>`` (what
the ``openai`` client sends) or ``x-api-key: <key>`` (what the ``anthropic`` client
sends); others get a 401 before any route runs, with OpenAI's error body (Anthropic's
under ``/v1/messages``).
``/health``, ``/metrics``, ``/tokenize`` and ``/detokenize`` stay open, as in vLLM, so
probes and scrapers need no secret. Keys are compared in constant time.
"""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Receive, Scope, Send


class ApiKeyMiddleware:
    """A pure ASGI middleware (no body buffering, streaming answers untouched)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1") or \
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
                if hmac.compare_digest(value[7:].strip(), self._key):
                    return True
            elif name == b"x-api-key" and hmac.compare_digest(value.strip(), self._key):
                return True
        return False
