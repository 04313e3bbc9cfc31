"""Admission hardening of the HTTP API (issue 23): bad input is a 400 (or 431 for headers)
with an OpenAI error body, never a 500 and never silently coerced, and nothing of it reaches
the engine: the stack is idle and clean afterwards and still answers a good request.

Raw bodies go through ``httpx`` (the ``openai`` client would refuse to send most of them).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from support.live_stack import LiveStack, assert_idle_and_clean, serving

pytestmark = pytest.mark.slow

SURROGATE = "\\ud800"  # a lone surrogate, as JSON text
CHAT = '{"model": "smollm2", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}'
COMPLETION = '{"model": "smollm2", "max_tokens": 2, "prompt": "hi"}'


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    with serving(smollm2_dir, tmp_path_factory.mktemp("admission") / "serve.log", 1,
                 "--num-kv-blocks", "128", "--max-model-len", "512") as s:
        yield s


def post(stack: LiveStack, path: str, body: str | bytes,
         headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(f"{stack.http}{path}", content=body, timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


def assert_400(r: httpx.Response, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def with_surrogate(body: dict[str, Any]) -> str:
    """``body`` as JSON with every "@S@" a lone surrogate escape."""
    return json.dumps(body).replace("@S@", SURROGATE)


MSG = {"role": "user", "content": "x"}
SURROGATE_BODIES = [
    ("/completions", {"model": "smollm2", "max_tokens": 2, "prompt": "a@S@b"}),
    ("/completions", {"model": "smollm2", "max_tokens": 2, "prompt": ["ok", "@S@"]}),
    ("/completions", {"model": "smollm2", "max_tokens": 2, "prompt": "hi", "stop": ["@S@"]}),
    ("/completions", {"model": "smollm@S@", "max_tokens": 2, "prompt": "hi"}),
    ("/completions", {"model": "smollm2", "max_tokens": 2, "prompt": "hi", "x@S@": 1}),
    ("/chat/completions", {"model": "smollm2", "max_tokens": 2,
                           "messages": [{**MSG, "content": "x@S@"}]}),
    ("/chat/completions", {"model": "smollm2", "max_tokens": 2,
                           "messages": [{**MSG, "role": "us@S@er"}]}),
    ("/chat/completions", {"model": "smollm2", "max_tokens": 2, "messages": [
        {**MSG, "content": [{"type": "text", "text": "@S@"}]}]}),
    ("/chat/completions", {"model": "smollm2", "max_tokens": 2, "messages": [MSG],
                           "response_format": {"type": "json_schema", "json_schema": {
                               "name": "a", "schema": {"type": "string", "pattern": "@S@"}}}}),
]


@pytest.mark.parametrize(("path", "body"), SURROGATE_BODIES)
def test_lone_surrogates_are_400(stack: LiveStack, path: str, body: dict[str, Any]) -> None:
    error = assert_400(post(stack, path, with_surrogate(body)))
    assert "surrogate" in error["message"], error


def test_a_valid_surrogate_pair_is_text(stack: LiveStack) -> None:
    body = '{"model": "smollm2", "max_tokens": 2, "prompt": "crab \\ud83e\\udd80"}'
    assert post(stack, "/completions", body).status_code == 200


def test_invalid_utf8_is_400(stack: LiveStack) -> None:
    assert_400(post(stack, "/completions", b'{"model": "smollm2", "prompt": "\xff\xfe"}'))


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", '"10"'), ("max_tokens", "true"), ("max_tokens", "2.0"), ("n", '"1"'),
    ("temperature", '"0.5"'), ("temperature", "true"), ("stream", '"yes"'), ("stream", "1"),
    ("logprobs", "false"), ("seed", '"7"'), ("echo", '"true"'), ("top_k", "1.5"),
])
def test_numbers_and_booleans_are_strict(stack: LiveStack, field: str, value: str) -> None:
    body = COMPLETION[:-1] + f', "{field}": {value}}}'
    assert_400(post(stack, "/completions", body.replace('"max_tokens": 2, ', "", 1)
                    if field == "max_tokens" else body), field)


@pytest.mark.parametrize("role", ["wizard", "", "USER", "function"])
def test_only_openai_roles(stack: LiveStack, role: str) -> None:
    body = CHAT.replace('"role": "user"', f'"role": "{role}"')
    assert_400(post(stack, "/chat/completions", body), "messages")


def test_message_count_is_bounded(stack: LiveStack) -> None:
    many = ", ".join(['{"role": "user", "content": "a"}'] * 2049)
    assert_400(post(stack, "/chat/completions",
                    f'{{"model": "smollm2", "max_tokens": 2, "messages": [{many}]}}'), "messages")


def test_oversized_headers_are_431(stack: LiveStack) -> None:
    # over the 32 KiB limit; far larger headers (past ~64 KiB) are refused too, but the
    # server may then reset the connection before the client reads the 431
    r = post(stack, "/completions", COMPLETION, {"x-padding": "a" * 40_000})
    assert r.status_code == 431 and r.json()["error"]["code"] == "headers_too_large"
    try:
        huge = post(stack, "/completions", COMPLETION, {"x-padding": "a" * 70_000})
    except httpx.TransportError:
        pass  # refused with a reset: never served
    else:
        assert huge.status_code == 431
    many = {f"x-h{i}": "1" for i in range(200)}
    assert post(stack, "/completions", COMPLETION, many).status_code == 431


def test_the_stack_is_clean_after_bad_input(stack: LiveStack) -> None:
    after = len(stack.log())
    assert post(stack, "/completions", COMPLETION).status_code == 200
    assert "Traceback" not in stack.log()
    assert_idle_and_clean(stack, after)
