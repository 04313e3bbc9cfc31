"""Anthropic's Messages API (``/v1/messages``) through a live `pagoda serve`, with the
official ``anthropic`` client.

The oracle is the OpenAI chat API of the same stack: a Messages request and the chat
request it maps to run the same prompt, so greedy answers and prompt sizes must agree.
The model is SmolLM2 with a Hermes tool template (``support/tool_model.py``), so tools
reach the prompt and ``auto`` has a parser; ``any`` and a named tool are enforced by
structured output, so their ``tool_use`` inputs must validate against the schemas.
Streamed answers (text and events) must equal the whole ones; errors come back as the
SDK's typed exceptions with Anthropic's error body.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from services.tokenizer.anthropic_protocol import MessagesRequest
from support.live_stack import LiveStack, assert_idle_and_clean, openai_client, serving
from support.tool_model import make_tool_model

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}}, "required": ["city"],
               "additionalProperties": False}}
TIME = {"name": "get_time", "description": "Get the local time in a time zone",
        "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                         "required": ["zone"], "additionalProperties": False}}
TOOLS = [WEATHER, TIME]
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
    for t in TOOLS]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
SYSTEM = "You are a terse assistant."
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY = {"temperature": 0}  # the anthropic SDK 2.x has no sampling parameters of its own


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    tmp = tmp_path_factory.mktemp("anthropic-serve")
    model = make_tool_model(smollm2_dir, tmp / "smollm2-tools")
    with serving(model, tmp / "serve.log", 1, "--num-kv-blocks", "256", "--max-model-len",
                 str(MAX_MODEL_LEN), "--max-num-seqs", "4") as s:
        yield s


@pytest.fixture(scope="module")
def oai(stack: LiveStack) -> openai.OpenAI:
    return openai_client(stack)


@pytest.fixture(scope="module")
def model(oai: openai.OpenAI) -> str:
    return oai.models.list().data[0].id


@pytest.fixture(scope="module")
def client(stack: LiveStack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.http.removesuffix("/v1"), api_key="unused",
                               max_retries=0, timeout=120)


def text_of(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


RAW_EVENTS = {"message_start", "content_block_start", "content_block_delta",
              "content_block_stop", "message_delta", "message_stop"}


def streamed(client: anthropic.Anthropic, **kwargs: Any) -> tuple[str, Any, list[str]]:
    """(the text as the stream's text events give it, the final message, the types of
    the server's events in order) of a streamed request."""
    text, types = "", []
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "text":
                text += event.text
            elif event.type in RAW_EVENTS:
                types.append(event.type)
        return text, stream.get_final_message(), types


def blocks(message: Any) -> list[dict[str, Any]]:
    """The content blocks, tool_use ids left out (each request draws its own)."""
    return [{**b.model_dump(), **({"id": None} if b.type == "tool_use" else {})}
            for b in message.content]


def same_answer(a: Any, b: Any) -> None:
    assert blocks(a) == blocks(b)
    assert (a.stop_reason, a.stop_sequence) == (b.stop_reason, b.stop_sequence)
    assert (a.usage.input_tokens, a.usage.output_tokens) == (
        b.usage.input_tokens, b.usage.output_tokens)


ANSWER = {"system": SYSTEM, "messages": ASK, "max_tokens": 16, "extra_body": GREEDY}


@pytest.fixture(scope="module")
def answer(client: anthropic.Anthropic, model: str) -> Any:
    """The whole greedy answer to ``ANSWER``."""
    return client.messages.create(model=model, **ANSWER)  # type: ignore[arg-type]


def test_greedy_text_equals_the_chat_apis(client: anthropic.Anthropic, oai: openai.OpenAI,
                                          model: str, answer: Any) -> None:
    chat = oai.chat.completions.create(
        model=model, messages=[{"role": "system", "content": SYSTEM}, *ASK],  # type: ignore[list-item]
        max_tokens=16, temperature=0)
    r = answer
    assert r.id.startswith("msg_") and (r.type, r.role, r.model) == ("message", "assistant", model)
    assert text_of(r) == chat.choices[0].message.content and [b.type for b in r.content] == ["text"]
    assert r.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
        chat.choices[0].finish_reason]
    assert chat.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens)
    # system and content as text blocks (cache_control accepted) give the same prompt
    as_blocks = client.messages.create(
        model=model, max_tokens=16, extra_body=GREEDY,
        system=[{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}],
        metadata={"user_id": "u1"})
    same_answer(as_blocks, r)
    count = client.messages.count_tokens(model=model, system=SYSTEM, messages=ASK)  # type: ignore[arg-type]
    assert count.input_tokens == r.usage.input_tokens


def test_streamed_equals_whole(client: anthropic.Anthropic, model: str, answer: Any) -> None:
    text, final, events = streamed(client, model=model, **ANSWER)
    assert text == text_of(answer) != ""
    same_answer(final, answer)
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}


def test_stop_sequences_and_max_tokens(client: anthropic.Anthropic, model: str,
                                       answer: Any) -> None:
    kwargs: dict[str, Any] = {**ANSWER, "model": model}
    whole = text_of(answer)
    word = whole.split()[2]  # a word in the middle of the answer
    r = client.messages.create(**kwargs, stop_sequences=[word, "never seen"])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", word)
    assert text_of(r) == whole[: whole.index(word)]
    _, final, _ = streamed(client, **kwargs, stop_sequences=[word])
    assert (final.stop_reason, final.stop_sequence, text_of(final)) == (
        "stop_sequence", word, text_of(r))
    r = client.messages.create(**{**kwargs, "max_tokens": 3})
    assert (r.stop_reason, r.stop_sequence, r.usage.output_tokens) == ("max_tokens", None, 3)


def test_max_tokens_over_the_context_window_is_cut_to_it(client: anthropic.Anthropic,
                                                         model: str) -> None:
    """Anthropic's rule: ``max_tokens`` is a ceiling; the answer fills the window."""
    target, words = MAX_MODEL_LEN - 4, MAX_MODEL_LEN - 40
    for _ in range(3):  # "hello " is about a token: a few counts reach the target length
        # a prefill the model goes on with: more "hello"s, never the end of its turn
        messages = [{"role": "user", "content": "Say hello forever."},
                    {"role": "assistant", "content": ("hello " * words).strip()}]
        n = client.messages.count_tokens(model=model, messages=messages).input_tokens  # type: ignore[arg-type]
        words += target - n
    assert n == target
    r = client.messages.create(model=model, messages=messages, max_tokens=4096,  # type: ignore[arg-type]
                               extra_body={**GREEDY, "top_k": 1, "top_p": 0.9})
    assert (r.stop_reason, r.usage.input_tokens, r.usage.output_tokens) == (
        "model_context_window_exceeded", target, 4), r


def test_a_final_assistant_message_is_continued(client: anthropic.Anthropic,
                                                oai: openai.OpenAI, model: str) -> None:
    prefill = [*ASK, {"role": "assistant", "content": "The capital of France is"}]
    chat = oai.chat.completions.create(
        model=model, messages=prefill, max_tokens=8, temperature=0,  # type: ignore[arg-type]
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    r = client.messages.create(model=model, messages=prefill, max_tokens=8, extra_body=GREEDY)  # type: ignore[arg-type]
    assert text_of(r) == chat.choices[0].message.content
    assert chat.usage is not None and r.usage.input_tokens == chat.usage.prompt_tokens


def test_output_config_format_is_structured_output(client: anthropic.Anthropic,
                                                  model: str) -> None:
    schema = WEATHER["input_schema"]
    r = client.messages.create(model=model, messages=WEATHER_ASK, max_tokens=32,
                               output_config={"format": {"type": "json_schema", "schema": schema}})
    assert r.stop_reason == "end_turn", r
    jsonschema.validate(json.loads(text_of(r)), schema)


def test_any_and_named_tool_choices_give_valid_calls(stack: LiveStack,
                                                     client: anthropic.Anthropic,
                                                     model: str) -> None:
    after = len(stack.log())
    for choice, stream in (({"type": "any", "disable_parallel_tool_use": True}, True),
                           ({"type": "any"}, False), ({"type": "tool", "name": "get_time"}, False)):
        kwargs: dict[str, Any] = {"model": model, "messages": WEATHER_ASK, "tools": TOOLS,
                                  "tool_choice": choice, "max_tokens": 64, "extra_body": GREEDY}
        r = client.messages.create(**kwargs)
        calls = [b for b in r.content if b.type == "tool_use"]
        assert r.stop_reason == "tool_use" and calls and len(calls) == len(r.content), r
        if choice["type"] == "tool":
            assert [c.name for c in calls] == ["get_time"]
        if choice.get("disable_parallel_tool_use"):
            assert len(calls) == 1
        for call in calls:
            jsonschema.validate(call.input, SCHEMAS[call.name])
            assert call.id.startswith("call_")
        if stream:
            _, final, _ = streamed(client, **kwargs)
            same_answer(final, r)
    # the answer goes back as it came, with the results of its calls
    history = [*WEATHER_ASK, {"role": "assistant", "content": r.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": c.id,
                                             "content": "12:00"} for c in calls]}]
    r = client.messages.create(model=model, messages=history, tools=TOOLS, max_tokens=1)  # type: ignore[arg-type]
    assert r.usage.output_tokens == 1
    assert_idle_and_clean(stack, after)


def test_tool_history_and_auto(client: anthropic.Anthropic, oai: openai.OpenAI,
                               model: str) -> None:
    """A tool_use / tool_result history reaches the template as the chat API's tool
    calls and tool messages do; ``auto`` (Hermes parser) streams what it answers whole."""
    history = [*WEATHER_ASK,
               {"role": "assistant", "content": [
                   {"type": "text", "text": "Let me check."},
                   {"type": "tool_use", "id": "call_abc", "name": "get_weather",
                    "input": {"city": "Paris"}}]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": "call_abc",
                    "content": [{"type": "text", "text": "18 C and sunny"}]}]}]
    chat_history = [*WEATHER_ASK,
                    {"role": "assistant", "content": "Let me check.", "tool_calls": [{
                        "id": "call_abc", "type": "function", "function": {
                            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                    {"role": "tool", "tool_call_id": "call_abc", "content": "18 C and sunny"}]
    chat = oai.chat.completions.create(model=model, messages=chat_history, tools=OPENAI_TOOLS,  # type: ignore[arg-type]
                                       max_tokens=16, temperature=0)
    kwargs: dict[str, Any] = {"model": model, "messages": history, "tools": TOOLS,
                              "max_tokens": 16, "extra_body": GREEDY}
    r = client.messages.create(**kwargs)
    assert chat.usage is not None and r.usage.input_tokens == chat.usage.prompt_tokens
    assert text_of(r) == (chat.choices[0].message.content or "")
    assert client.messages.count_tokens(model=model, messages=history, tools=TOOLS  # type: ignore[arg-type]
                                        ).input_tokens == r.usage.input_tokens
    _, final, _ = streamed(client, **kwargs)
    same_answer(final, r)
    # an error result and the text after it are accepted too
    history[-1]["content"] = [{"type": "tool_result", "tool_use_id": "call_abc",  # type: ignore[index]
                               "content": "no such city", "is_error": True},
                              {"type": "text", "text": "Try again."}]
    r = client.messages.create(**{**kwargs, "max_tokens": 2})
    assert r.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_blocks_become_chat_turns_in_order() -> None:
    """In-process: text around tool results keeps its place; thinking is dropped."""
    body = MessagesRequest.model_validate({
        "model": "m", "max_tokens": 1, "system": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}],
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "s"},
                {"type": "tool_use", "id": "c1", "name": "f", "input": {"x": 1}}]},
            {"role": "user", "content": [
                {"type": "text", "text": "before"},
                {"type": "tool_result", "tool_use_id": "c1", "content": "out", "is_error": True},
                {"type": "text", "text": "after"}]}]})
    turns = [(t.role, t.content, t.tool_call_id) for t in body.turns()]
    assert turns == [("system", "a\nb", None), ("user", "hi", None), ("assistant", None, None),
                     ("user", "before", None), ("tool", "Error: out", "c1"),
                     ("user", "after", None)]
    assert body.turns()[2].tool_calls[0]["function"] == {"name": "f", "arguments": {"x": 1}}


def test_bad_requests_are_anthropic_errors(stack: LiveStack, client: anthropic.Anthropic,
                                           model: str) -> None:
    after = len(stack.log())
    base: dict[str, Any] = {"model": model, "messages": ASK, "max_tokens": 4}
    bad: list[tuple[dict[str, Any], type[anthropic.APIStatusError], str]] = [
        ({"extra_body": {"frequency_penalty": 1}}, anthropic.BadRequestError, "frequency_penalty"),
        ({"messages": [*ASK, {"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "x", "content": "y"}]}]},
         anthropic.BadRequestError, "tool_result blocks belong in user messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/png", "data": "AA=="}}]}]},
         anthropic.BadRequestError, "'image' are not supported"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
         anthropic.BadRequestError, "not one of the tools"),
        ({"max_tokens": 0}, anthropic.BadRequestError, "max_tokens"),
        ({"tools": TOOLS, "tool_choice": {"type": "any"}, "output_config": {
            "format": {"type": "json_schema", "schema": {"type": "object"}}}},
         anthropic.BadRequestError, "cannot be combined"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "cache_control": {
            "type": "ephemeral"}, "extra_body": {"top_k": -5}}, anthropic.BadRequestError, "top_k"),
        ({"model": "claude-nope"}, anthropic.NotFoundError, "claude-nope"),
    ]
    for extra, error, says in bad:
        with pytest.raises(error) as e:
            client.messages.create(**{**base, **extra})
        body = e.value.body
        assert isinstance(body, dict) and body["type"] == "error", body
        kind = "not_found_error" if error is anthropic.NotFoundError else "invalid_request_error"
        assert body["error"]["type"] == kind and says in body["error"]["message"], body
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nope", messages=ASK)  # type: ignore[arg-type]
    root = stack.http.removesuffix("/v1")
    no_max_tokens = json.dumps({"model": model, "messages": ASK})
    strings = json.dumps({"model": model, "messages": ASK, "max_tokens": "4"})
    surrogate = no_max_tokens.replace("capital", "capital \\ud800")[:-1] + ', "max_tokens": 4}'
    for raw, says in ((no_max_tokens, "missing required parameter: 'max_tokens'"),
                      ("{not json", "not valid JSON"), ("[1, 2]", "must be a JSON object"),
                      (strings, "max_tokens: Input should be a valid integer"),
                      (surrogate, "messages[0].content: contains a lone surrogate")):
        r = httpx.post(f"{root}/v1/messages", content=raw,
                       headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json() == {"type": "error", "error": {
            "type": "invalid_request_error", "message": r.json()["error"]["message"]}}
        assert says in r.json()["error"]["message"], r.text
    # the other routes keep OpenAI's error shape
    r = httpx.post(f"{root}/v1/chat/completions", json={"messages": ASK, "bogus": 1})
    assert r.status_code == 400 and set(r.json()) == {"error"}, r.text
    assert client.messages.create(**base).stop_reason == "max_tokens"  # still serving
    assert_idle_and_clean(stack, after)
