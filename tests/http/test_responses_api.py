"""OpenAI's Responses API (``/v1/responses``) through a live `pagoda serve`, with the
official ``openai`` client.

The model is SmolLM2 with a Hermes tool template (``support/tool_model.py``). The oracle
is the chat completions API of the same server: a greedy response's text, input and
output token counts equal those of the chat request with the equivalent messages
(``instructions`` as a system message, a ``previous_response_id`` conversation as its
history, tool calls and their outputs as assistant tool calls and tool messages).
Streamed events concatenate to the whole answer and carry increasing sequence numbers;
``text.format`` and ``tool_choice: required`` outputs validate against their schemas.
The store keeps ``--responses-max-stored 4`` responses: an evicted, unstored or deleted
id is a 404. Fields this server does not serve are 400s naming them.
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

from services.tokenizer.input_processor import ChatTurn
from services.tokenizer.responses_store import ResponsesStore, StoredResponse
from support.live_stack import LiveStack, assert_idle_and_clean, served_client, serving
from support.tool_model import make_tool_model

pytestmark = pytest.mark.slow

MAX_STORED = 4
WEATHER = {"type": "function", "name": "get_weather",
           "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20}},
               "required": ["city"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "adult": {"type": "boolean"}}, "required": ["name", "adult"], "additionalProperties": False}
QUESTION = "Name three colours of the rainbow."


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    tmp = tmp_path_factory.mktemp("responses-serve")
    model = make_tool_model(smollm2_dir, tmp / "smollm2-tools")
    with serving(model, tmp / "serve.log", 1, "--num-kv-blocks", "256", "--max-model-len",
                 "2048", "--max-num-seqs", "4", "--responses-max-stored", str(MAX_STORED)) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack: LiveStack) -> openai.OpenAI:
    return served_client(stack)


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int,
         **kw: Any) -> Any:
    return client.chat.completions.create(model=client.model, messages=messages,  # type: ignore[attr-defined]
                                          max_tokens=max_tokens, temperature=0, **kw)


def respond(client: openai.OpenAI, **kw: Any) -> Any:
    return client.responses.create(model=client.model, temperature=0, **kw)  # type: ignore[attr-defined]


def assert_same_as_chat(r: Any, c: Any) -> None:
    """A response against the chat completion of the equivalent messages."""
    assert r.output_text == c.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (
        c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if c.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None


def test_greedy_text_equals_chat(stack: LiveStack, client: openai.OpenAI) -> None:
    after = len(stack.log())
    r = respond(client, input=QUESTION, instructions="Answer briefly.", max_output_tokens=12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == client.model  # type: ignore[attr-defined]
    assert [item.type for item in r.output] == ["message"] and r.output[0].role == "assistant"
    c = chat(client, [{"role": "system", "content": "Answer briefly."},
                      {"role": "user", "content": QUESTION}], 12)
    assert_same_as_chat(r, c)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    # items: developer is a system message, content parts join with newlines as in chat
    items = [{"role": "developer", "content": "Answer briefly."},
             {"type": "message", "role": "user",
              "content": [{"type": "input_text", "text": "Hello."},
                          {"type": "input_text", "text": QUESTION}]}]
    r = respond(client, input=items, max_output_tokens=16)
    c = chat(client, [{"role": "system", "content": "Answer briefly."},
                      {"role": "user", "content": f"Hello.\n{QUESTION}"}], 16)
    assert_same_as_chat(r, c)
    assert_idle_and_clean(stack, after)


def test_stream_events_add_up_to_the_whole(client: openai.OpenAI) -> None:
    whole = respond(client, input=QUESTION, max_output_tokens=10)
    events = list(respond(client, input=QUESTION, max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-4].text and deltas
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        whole.usage.input_tokens, whole.usage.output_tokens)
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again
    assert final.status == whole.status == "incomplete"
    assert client.responses.retrieve(final.id).output_text == whole.output_text


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = respond(client, input="My name is Ada. Say hello to me.",
                    instructions="Answer briefly.", max_output_tokens=8)
    second = respond(client, input="What is my name?", previous_response_id=first.id,
                     max_output_tokens=8)
    assert second.previous_response_id == first.id
    # the first response's instructions are not carried over (OpenAI's rule)
    c = chat(client, [{"role": "user", "content": "My name is Ada. Say hello to me."},
                      {"role": "assistant", "content": first.output_text},
                      {"role": "user", "content": "What is my name?"}], 8)
    assert_same_as_chat(second, c)


def test_store_false_eviction_and_delete_are_404s(client: openai.OpenAI) -> None:
    unstored = respond(client, input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(unstored.id)
    assert e.value.body["code"] == "response_not_found"  # type: ignore[index]
    ids = [respond(client, input="Hi", max_output_tokens=1).id for _ in range(MAX_STORED + 1)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # the oldest went when the fifth came
    with pytest.raises(openai.NotFoundError) as e:
        respond(client, input="Hi", max_output_tokens=1, previous_response_id=ids[0])
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    client.responses.delete(ids[-1])
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[-1])


def test_text_format_json_schema_validates(client: openai.OpenAI) -> None:
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    r = respond(client, input="Describe a person as JSON.", text=fmt, max_output_tokens=60)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.schema_ == PERSON


def function_calls(r: Any) -> list[tuple[str, str]]:
    return [(item.name, item.arguments) for item in r.output if item.type == "function_call"]


def test_tool_choice_required_gives_a_valid_call(stack: LiveStack, client: openai.OpenAI) -> None:
    after = len(stack.log())
    ask = "What is the weather like in Paris today?"
    kw = {"input": ask, "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 40}
    r = respond(client, **kw)
    assert r.status == "completed" and r.output_text == ""
    [(name, arguments)] = function_calls(r)
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER["parameters"])
    call = r.output[0]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    # a named function, streamed: the arguments' deltas add up to the call
    named = {**kw, "tool_choice": {"type": "function", "name": "get_weather"}}
    events = list(respond(client, stream=True, **named))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [(e.type, e.item.type) for e in events if e.type.startswith("response.output_item")] == [
        ("response.output_item.added", "function_call"), ("response.output_item.done", "function_call")]
    assert function_calls(events[-1].response) == [("get_weather", deltas)] and deltas == done.arguments
    jsonschema.validate(json.loads(deltas), WEATHER["parameters"])
    # the call's result, sent back: the prompt is the chat API's tool history
    follow = respond(client, previous_response_id=r.id, tools=[WEATHER], tool_choice="none",
                     input=[{"type": "function_call_output", "call_id": call.call_id,
                             "output": "18 C and sunny"}], max_output_tokens=8)
    c = chat(client, [{"role": "user", "content": ask},
                      {"role": "assistant", "content": None, "tool_calls": [{
                          "id": call.call_id, "type": "function",
                          "function": {"name": name, "arguments": arguments}}]},
                      {"role": "tool", "tool_call_id": call.call_id, "content": "18 C and sunny"}],
             8, tools=[{"type": "function", "function": {
                 k: v for k, v in WEATHER.items() if k != "type"}}], tool_choice="none")
    assert_same_as_chat(follow, c)
    assert_idle_and_clean(stack, after)


def test_auto_parses_text_and_a_call_whole_and_streamed(client: openai.OpenAI) -> None:
    """A Hermes call the model must write (vLLM's ``structured_outputs`` choice) comes
    back as a message and a function_call item, the same whole and streamed."""
    call = {"name": "get_weather", "arguments": {"city": "Paris"}}
    text = f"Checking.\n<tool_call>\n{json.dumps(call)}\n</tool_call>"
    kw = {"input": "What is the weather in Paris?", "tools": [WEATHER], "max_output_tokens": 64,
          "extra_body": {"structured_outputs": {"choice": [text]}}}
    r = respond(client, **kw)
    expected = [("message", "Checking."), ("function_call", json.dumps(call["arguments"]))]
    got = [(i.type, i.content[0].text if i.type == "message" else i.arguments) for i in r.output]
    assert got == expected and r.status == "completed"
    events = list(respond(client, stream=True, **kw))
    text_deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert [("message", text_deltas), ("function_call", args)] == expected
    final = events[-1].response
    assert [(i.type, i.id) for i in final.output] == [
        (e.item.type, e.item.id) for e in events if e.type == "response.output_item.added"]


def test_bad_requests_are_400s_naming_the_field(stack: LiveStack, client: openai.OpenAI) -> None:
    url = f"{stack.http}/responses"
    base = {"model": client.model, "input": "Hi", "max_output_tokens": 2}  # type: ignore[attr-defined]
    bad: list[tuple[dict[str, Any], str]] = [
        ({"frobnicate": 1}, "frobnicate"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
        ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}},
         "structured_outputs"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ]
    for extra, param in bad:
        r = httpx.post(url, json={**base, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (extra, error)
    for raw, param in (('{"input": "a\\ud800"}', "input"),
                       ('{"input": "a", "instructions": "\\udfff"}', "instructions")):
        r = httpx.post(url, content=raw, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.post(url, json={**base, "reasoning": None, "background": False}).status_code == 200
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=client.model, input="Hi", background=True)  # type: ignore[attr-defined]


def test_store_bounds_number_and_age() -> None:
    now = [0.0]
    store = ResponsesStore(2, 10.0, clock=lambda: now[0])
    entry = StoredResponse({"id": "x"}, (ChatTurn("user", "hi"),))
    for key in ("a", "b", "c"):
        store.put(key, entry)
    assert (store.get("a"), store.get("c"), len(store)) == (None, entry, 2)
    now[0] = 10.0
    assert store.get("b") is None and len(store) == 0
    off = ResponsesStore(0, 1.0)
    off.put("a", entry)
    assert off.get("a") is None
