"""Structured output through a live `pagoda serve` (scheduler process, worker, frontend)
on a tiny random checkpoint with SmolLM2's tokenizer and chat template: the official
``openai`` client (response_format json_schema / json_object, vLLM's structured_outputs
and guided_* extra bodies; chat and completions; streamed and not; n > 1; greedy and
seeded) and the native client. Whatever the random model prefers, outputs validate.
Invalid constraints are a 400 naming them; the stack goes back to idle and clean."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from pagoda.client import Client
from support.live_stack import LiveStack, assert_idle_and_clean, served_client, serving

pytestmark = pytest.mark.slow

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 10**7},
        "coastal": {"type": "boolean"},
    },
    "required": ["city", "population", "coastal"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHAT = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.fixture(scope="module")
def stack(tiny_smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    log_path = tmp_path_factory.mktemp("so-serve") / "serve.log"
    with serving(tiny_smollm_dir, log_path, 1, "--num-kv-blocks", "256", "--max-model-len",
                    "512", "--max-num-seqs", "8") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: LiveStack) -> openai.OpenAI:
    return served_client(stack)


def valid(text: str) -> dict[str, Any]:
    data = json.loads(text)
    jsonschema.validate(data, SCHEMA)
    return data  # type: ignore[no-any-return]


RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 1), (1.0, 2)])
def test_chat_response_format_json_schema(client: openai.OpenAI, temperature: float,
                                          seed: int | None) -> None:
    got = client.chat.completions.create(
        model=client.model, messages=CHAT, response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
        max_tokens=80, temperature=temperature, seed=seed, n=2)
    for choice in got.choices:
        assert choice.finish_reason == "stop", choice
        valid(choice.message.content or "")


def test_chat_streamed_json_schema_with_n(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=client.model, messages=CHAT, response_format=RESPONSE_FORMAT,  # type: ignore[arg-type]
        max_tokens=80, temperature=1.0, seed=7, n=3, stream=True)
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert reasons == ["stop"] * 3
    for text in texts:
        valid(text)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_regex_and_legacy_choice(client: openai.OpenAI, stream: bool) -> None:
    for seed in (None, 3, 4):
        body = {"structured_outputs": {"regex": PHONE}}
        text, reason = _completion(client, body, stream, seed)
        assert reason == "stop" and re.fullmatch(PHONE, text), text
    choices = ["alpha", "beta", "gamma delta"]
    text, reason = _completion(client, {"guided_choice": choices}, stream, 5)
    assert reason == "stop" and text in choices, text


def _completion(client: openai.OpenAI, extra: dict[str, Any], stream: bool,
                seed: int | None) -> tuple[str, str | None]:
    kw: dict[str, Any] = {"model": client.model, "prompt": "Call me at", "max_tokens": 40,
                          "temperature": 0.0 if seed is None else 1.0, "seed": seed,
                          "extra_body": extra}
    if not stream:
        choice = client.completions.create(**kw).choices[0]
        return choice.text, choice.finish_reason
    text, reason = "", None
    for chunk in client.completions.create(stream=True, **kw):
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_json_object_and_guided_json(client: openai.OpenAI) -> None:
    # any object: a random model may write long strings, so the finished ones are checked
    finished = 0
    for seed in range(6):
        got = client.chat.completions.create(
            model=client.model, messages=CHAT, response_format={"type": "json_object"}, max_tokens=48,
            temperature=1.0, seed=seed).choices[0]
        if got.finish_reason == "stop":
            finished += 1
            assert isinstance(json.loads(got.message.content or ""), dict)
    assert finished, "no json_object output finished within max_tokens"
    for extra in ({"guided_json": SCHEMA}, {"response_format": RESPONSE_FORMAT}):
        got = client.completions.create(model=client.model, prompt="A city:",
                                        max_tokens=80, temperature=0.0, extra_body=extra).choices[0]
        assert got.finish_reason == "stop"
        valid(got.text)


def test_native_client(stack: LiveStack) -> None:
    with Client(stack.frontends[0], timeout=60) as c:
        result = c.generate("A city:", max_tokens=80, temperature=1.0, seed=3, n=2,
                            structured_outputs={"json": SCHEMA})
        for sample in result.outputs:
            assert sample.finish_reason == "stop"
            valid(sample.text)
        text = "".join(out.text for out in c.stream(
            "Call me at", max_tokens=40, temperature=0.0,
            structured_outputs={"regex": PHONE}))
        assert re.fullmatch(PHONE, text), text


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"regex": "(unclosed"}}, "parenthesis"),
    ({"structured_outputs": {"json": {"type": "no-such-type"}}}, "no-such-type"),
    ({"guided_grammar": "root ::= missing"}, "missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "json_schema.schema"),
    ({"guided_regex": "a+", "structured_outputs": {"regex": "b+"}}, "guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
])
def test_invalid_constraints_are_400(stack: LiveStack, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{stack.http}/completions", json={"prompt": "hi", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and param in error["message"], error


def test_back_to_idle_and_clean(stack: LiveStack, client: openai.OpenAI) -> None:
    after = len(stack.log())
    client.completions.create(model=client.model, prompt="x", max_tokens=4, temperature=0.0,
                              extra_body={"structured_outputs": {"choice": ["ok"]}})
    assert_idle_and_clean(stack, after)
