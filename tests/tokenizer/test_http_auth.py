"""API keys from the settings and a key file (services/tokenizer/http_auth.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.tokenizer.http_auth import api_keys


def test_keys_from_the_setting_and_the_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# comment\nk2\n\n  k3  \n")
    path.chmod(0o600)
    assert api_keys("k0, k1", str(path)) == ["k0", "k1", "k2", "k3"]
    assert api_keys(None, None) == []


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o644])
def test_a_key_file_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "keys"
    path.write_text("k\n")
    path.chmod(mode)
    with pytest.raises(ValueError, match="chmod 600"):
        api_keys(None, str(path))


def test_open_paths_are_configurable() -> None:
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from services.tokenizer.http_auth import ApiKeyMiddleware

    async def ok(request: object) -> PlainTextResponse:
        return PlainTextResponse("ok")

    inner = Starlette(routes=[Route(p, ok) for p in ("/health", "/metrics", "/v1/models")])
    for open_paths, health in ((frozenset({"/health"}), 200), (frozenset(), 401)):
        client = TestClient(ApiKeyMiddleware(inner, ["k"], open_paths))
        assert client.get("/health").status_code == health
        assert client.get("/metrics").status_code == 401
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200
        assert client.get("/metrics", headers={"x-api-key": "k"}).status_code == 200
