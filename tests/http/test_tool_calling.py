"""Tool calling through a live `pagoda serve` with the official ``openai`` client.

The model is the real SmolLM2 with a Qwen-style (Hermes) tool template
(``support/tool_model.py``), so ``--tool-call-parser auto`` picks ``hermes``. A 135M
model calls tools only when it feels like it, so ``auto`` is checked for what holds
whatever it writes: the tools are in the prompt (``/tokenize`` with tools, and the chat
request's prompt_tokens agree), a history with tool calls and tool results is accepted,
and the streamed answer (content and tool call deltas, put together) equals the whole
one; a call forced through structured output comes back parsed. The parsers' cases are
``tests/tokenizer/test_tool_parsers.py``'s. ``required`` and a named function are
enforced by structured output, so they must give valid calls. The native client
(``pagoda.client``) gets the same calls as the HTTP API for the same request.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from pagoda.client import Client, InvalidRequestError
from support.live_stack import LiveStack, assert_idle_and_clean, served_client, serving
from support.tool_model import make_tool_model

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "the city, e.g. Paris", "maxLength": 20}},
        "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a time zone",
    "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 20}}, "required": ["zone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
HISTORY = [*ASK,
           {"role": "assistant", "content": None, "tool_calls": [{
               "id": "call_abc", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_abc", "content": "18 C and sunny"}]


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    tmp = tmp_path_factory.mktemp("tools-serve")
    model = make_tool_model(smollm2_dir, tmp / "smollm2-tools")
    with serving(model, tmp / "serve.log", 1, "--num-kv-blocks", "256", "--max-model-len",
                    "2048", "--max-num-seqs", "4") as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: LiveStack) -> openai.OpenAI:
    return served_client(stack)


def tokenize(stack: LiveStack, messages: list[dict[str, Any]], tools: list[Any] | None) -> Any:
    body: dict[str, Any] = {"messages": messages, **({"tools": tools} if tools else {})}
    r = httpx.post(f"{stack.http.removesuffix('/v1')}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_tools_reach_the_prompt_and_history_is_accepted(stack: LiveStack,
                                                        client: openai.OpenAI) -> None:
    assert "tool call parser: hermes (auto: the chat template mentions <tool_call>)" in stack.log()
    with_tools, without = tokenize(stack, ASK, TOOLS), tokenize(stack, ASK, None)
    root = stack.http.removesuffix("/v1")
    prompt = httpx.post(f"{root}/detokenize", json={"tokens": with_tools["tokens"]}).json()["prompt"]
    assert json.dumps(WEATHER) in prompt and "<tool_call>" in prompt
    assert with_tools["count"] > without["count"]
    r = client.chat.completions.create(model=client.model, messages=ASK, tools=TOOLS,  # type: ignore[attr-defined]
                                       max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == with_tools["count"]
    history = tokenize(stack, HISTORY, TOOLS)
    prompt = httpx.post(f"{root}/detokenize", json={"tokens": history["tokens"]}).json()["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18 C and sunny\n</tool_response>" in prompt
    r = client.chat.completions.create(model=client.model, messages=HISTORY, tools=TOOLS,  # type: ignore[attr-defined]
                                       max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == history["count"]


def streamed(stream: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish_reason) of a stream, as a client assembles it."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                if call.id is not None:
                    assert call.index not in calls and call.type == "function"
                    calls[call.index] = [call.function.name, ""]
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish  # type: ignore[misc]


def whole(r: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    message = r.choices[0].message
    calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    return message.content or "", calls, r.choices[0].finish_reason


@pytest.mark.parametrize("messages", [ASK, HISTORY], ids=["ask", "history"])
def test_auto_streamed_equals_whole(client: openai.OpenAI, messages: list[Any]) -> None:
    kwargs = {"model": client.model, "messages": messages, "tools": TOOLS,  # type: ignore[attr-defined]
              "max_tokens": 48, "temperature": 0}
    expected = whole(client.chat.completions.create(**kwargs))
    assert streamed(client.chat.completions.create(stream=True, **kwargs)) == expected
    if expected[1]:
        assert expected[2] == "tool_calls"


def test_auto_parses_a_call_the_model_writes(client: openai.OpenAI) -> None:
    """A call in the Hermes format, forced through structured output (``choice``: the
    model can write only this text), comes back parsed, whole and streamed."""
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    text = f"Checking.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
    kwargs = {"model": client.model, "messages": ASK, "tools": TOOLS, "max_tokens": 64,  # type: ignore[attr-defined]
              "temperature": 0, "extra_body": {"structured_outputs": {"choice": [text]}}}
    expected = ("Checking.", [("get_weather", json.dumps(call["arguments"]))], "tool_calls")
    assert whole(client.chat.completions.create(**kwargs)) == expected
    assert streamed(client.chat.completions.create(stream=True, **kwargs)) == expected


def test_required_and_named_give_valid_calls(stack: LiveStack, client: openai.OpenAI) -> None:
    after = len(stack.log())
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice, parallel in ((named, True), ("required", False), ("required", True)):
        kwargs = {"model": client.model, "messages": ASK, "tools": TOOLS,  # type: ignore[attr-defined]
                  "tool_choice": choice, "parallel_tool_calls": parallel, "max_tokens": 64,
                  "temperature": 0}
        r = client.chat.completions.create(**kwargs)
        content, calls, finish = whole(r)
        assert finish == "tool_calls" and content == "" and calls, r
        if choice is named:
            assert [name for name, _ in calls] == ["get_time"]
        if not parallel:
            assert len(calls) == 1
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert r.choices[0].message.tool_calls[0].id.startswith("call_")
        assert streamed(client.chat.completions.create(stream=True, **kwargs)) == (
            content, calls, finish)
    assert_idle_and_clean(stack, after)


def test_bad_tool_requests_are_400s(client: openai.OpenAI) -> None:
    base = {"model": client.model, "messages": ASK, "max_tokens": 4}  # type: ignore[attr-defined]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}], "tools": TOOLS}, "messages"),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**{**base, **extra})
        assert e.value.body["param"] == param, e.value.body  # type: ignore[index]


# -- the same through the native client (pagoda.client) ----------------------------------


def native(stack: LiveStack) -> Client:
    return Client(stack.frontends[0], timeout=120)


def native_whole(result: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    sample = result.outputs[0]
    return sample.text, [(c.name, c.arguments) for c in sample.tool_calls], sample.finish_reason


def native_streamed(deltas: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for out in deltas:
        content += out.text
        for piece in out.tool_calls:
            if piece.id is not None:
                assert piece.index not in calls and piece.name
                calls[piece.index] = [piece.name, ""]
            calls[piece.index][1] += piece.arguments
        finish = out.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish  # type: ignore[misc]


def test_native_client_calls_tools_as_http_does(stack: LiveStack, client: openai.OpenAI) -> None:
    """``required``, a named function and ``auto`` through ``pagoda.client``: the same
    calls the HTTP API gives for the same greedy request, whole and streamed."""
    after = len(stack.log())
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    forced = f"Checking.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
    named = {"type": "function", "function": {"name": "get_time"}}
    cases: list[dict[str, Any]] = [
        {"tool_choice": named}, {"tool_choice": "required", "parallel_tool_calls": False},
        {"tool_choice": "auto", "structured_outputs": {"choice": [forced]}},
    ]
    with native(stack) as c:
        for case in cases:
            http_case = dict(case)
            if "structured_outputs" in http_case:
                http_case["extra_body"] = {"structured_outputs": http_case.pop("structured_outputs")}
            expected = whole(client.chat.completions.create(
                model=client.model, messages=ASK, tools=TOOLS, max_tokens=64,  # type: ignore[attr-defined]
                temperature=0, **http_case))
            assert expected[1] and expected[2] == "tool_calls", expected
            kwargs = {"messages": ASK, "tools": TOOLS, "max_tokens": 64, "temperature": 0, **case}
            result = c.generate(**kwargs)
            assert native_whole(result) == expected, case
            assert all(t.id and t.id.startswith("call_") for t in result.outputs[0].tool_calls)
            assert native_streamed(c.stream(**kwargs)) == expected, case
    assert_idle_and_clean(stack, after)


def test_native_client_sends_tool_history(stack: LiveStack) -> None:
    """Assistant tool calls and tool results in the history reach the template as the
    HTTP API renders them (same prompt length as ``/tokenize``)."""
    with native(stack) as c:
        r = c.generate(messages=HISTORY, tools=TOOLS, max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens == tokenize(stack, HISTORY, TOOLS)["count"]


def test_native_client_bad_tool_requests(stack: LiveStack) -> None:
    bad: list[dict[str, Any]] = [
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tool_choice": "required"},
        {"tools": [WEATHER, WEATHER]},
        {"tools": TOOLS, "tool_choice": "sometimes"},
        {"messages": [*ASK, {"role": "tool", "content": "x"}], "tools": TOOLS},
        {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
    ]
    with native(stack) as c:
        for extra in bad:
            with pytest.raises(InvalidRequestError):
                c.generate(**{"messages": ASK, "max_tokens": 4, **extra})
        with pytest.raises(InvalidRequestError, match="need messages"):
            c.generate("hello", tools=TOOLS, max_tokens=4)
        assert c.generate(messages=ASK, max_tokens=2).outputs[0].finish_reason == "length"
