"""Tool calling on the chat API, in-process: request checks, the constraints of
``required`` and a named function, the chat template with tools and a tool history, and
response shapes (whole and streamed) built from fabricated outputs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pydantic
import pytest

from services.tokenizer.http_errors import ApiError
from services.tokenizer.http_protocol import ChatCompletionRequest
from services.tokenizer.http_responses import ResponseBuilder
from services.tokenizer.input_processor import InputProcessor, ModelLimits, load_tokenizer
from services.tokenizer.output_processor import RequestState, SampleOutput
from services.tokenizer.tool_calls import MAX_TOOLS, ToolCalling, ToolCallOutput
from services.tokenizer.tool_parsers import HERMES
from shared.protocol import EngineOutput
from shared.sampling_params import SamplingParams
from shared.structured_output import check_constraint
from support.tool_model import make_tool_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
HISTORY = [*USER,
           {"role": "assistant", "content": None, "tool_calls": [{
               "id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]


def chat(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **body})


def tool_input(calling: ToolCalling | None = None, **body: Any) -> Any:
    return chat(**body).tool_input(calling or ToolCalling(HERMES))


def rejected(param: str, calling: ToolCalling | None = None, **body: Any) -> str:
    with pytest.raises(ApiError) as e:
        tool_input(calling, **body)
    assert e.value.status == 400 and e.value.param == param, e.value
    return str(e.value)


def test_tools_and_tool_choice_are_checked() -> None:
    rejected("tool_choice", tool_choice="auto")  # a choice without tools
    rejected("tool_choice", tools=[WEATHER],
             tool_choice={"type": "function", "function": {"name": "nope"}})
    rejected("tools", tools=[WEATHER, WEATHER])
    rejected("tools", tools=[{"type": "function", "function": {"name": "has space"}}])
    rejected("tools", tools=[{"type": "function", "function": {"name": f"t{i}"}}
                             for i in range(MAX_TOOLS + 1)])
    big = {"type": "function", "function": {"name": "big", "description": "x" * 300_000}}
    rejected("tools", tools=[big])
    assert "--tool-call-parser" in rejected("tool_choice", ToolCalling(None), tools=[WEATHER])
    with pytest.raises(pydantic.ValidationError):  # only function tools (a 400 over HTTP)
        ChatCompletionRequest.model_validate({"messages": USER, "tools": [{"type": "code"}]})


def test_choices_and_what_the_engine_runs() -> None:
    prompt, output = tool_input(tools=[WEATHER])  # auto by default
    assert prompt.tools == [WEATHER] and isinstance(output, ToolCallOutput)
    assert prompt.sampling_params.structured_outputs is None and prompt.skip_special_tokens
    prompt, output = tool_input(tools=[WEATHER], tool_choice="none")
    assert prompt.tools == [WEATHER] and output is None  # rendered, not parsed
    prompt, output = tool_input(ToolCalling(HERMES, keep_special_tokens=True), tools=[WEATHER])
    assert not prompt.skip_special_tokens
    prompt, _ = tool_input(ToolCalling(None), tools=[WEATHER], tool_choice="required")
    assert prompt.sampling_params.structured_outputs.json  # required needs no parser
    assert tool_input(tool_choice="none")[1] is None  # "none" without tools is fine
    rejected("tool_choice", tools=[WEATHER], tool_choice="required",
             response_format={"type": "json_object"})


def test_required_and_named_constraints() -> None:
    prompt, _ = tool_input(tools=[WEATHER, SEARCH], tool_choice="required")
    so = prompt.sampling_params.structured_outputs
    check_constraint(so)  # the structured-output engine compiles it
    schema = json.loads(so.json)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}},
                         {"name": "search", "parameters": {"q": "x"}}], schema)
    for bad in ([], [{"name": "search", "parameters": {"city": "Oslo"}}],
                [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    prompt, _ = tool_input(tools=[WEATHER, SEARCH], tool_choice="required",
                           parallel_tool_calls=False)
    assert json.loads(prompt.sampling_params.structured_outputs.json)["maxItems"] == 1
    prompt, _ = tool_input(tools=[WEATHER, SEARCH],
                           tool_choice={"type": "function", "function": {"name": "search"}})
    assert json.loads(prompt.sampling_params.structured_outputs.json) == SEARCH["function"][
        "parameters"]


def test_history_with_tool_calls() -> None:
    prompt, _ = tool_input(tools=[WEATHER], messages=HISTORY)
    assistant, tool = prompt.messages[1], prompt.messages[2]
    assert assistant.content is None
    assert assistant.tool_calls[0]["function"]["arguments"] == {"city": "Paris"}  # parsed
    assert tool.as_dict() == {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call_1"}
    bad_args = json.loads(json.dumps(HISTORY))
    bad_args[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
    assert "tool_calls[0].function.arguments" in rejected("messages", messages=bad_args)
    rejected("messages", messages=[*USER, {"role": "tool", "content": "x"}])  # no tool_call_id
    rejected("messages", messages=[{"role": "user", "content": None}])
    rejected("messages", messages=[{"role": "user", "content": "x", "tool_calls": HISTORY[1][
        "tool_calls"]}])


@pytest.fixture(scope="module")
def tool_tokenizer(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tokenizer(make_tool_model(smollm2_dir, tmp_path_factory.mktemp("tool-model") / "m"))


def test_template_renders_tools_and_history(tool_tokenizer: Any) -> None:
    processor = InputProcessor(tool_tokenizer, ModelLimits(2048, 49152))
    prompt, _ = tool_input(tools=[WEATHER], messages=HISTORY)
    text = processor.render_chat(prompt)
    assert json.dumps(WEATHER) in text and "<tool_call>" in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    plain = processor.render_chat(chat().prompt_input())
    assert "<tools>" not in plain  # no tools, no tool section
    assert ToolCalling.from_setting("auto", tool_tokenizer).fmt is HERMES


def test_special_tokens_kept_but_not_the_stop_token(tool_tokenizer: Any) -> None:
    ids = list(tool_tokenizer("<|im_start|>x", add_special_tokens=False)["input_ids"])
    eos = tool_tokenizer.convert_tokens_to_ids("<|im_end|>")
    outputs = []
    for skip in (True, False):
        state = RequestState("r", 0, SamplingParams(), 3, tool_tokenizer, False, [],
                             skip_special_tokens=skip)  # type: ignore[arg-type]
        out, _ = state.absorb(EngineOutput("r", 0, [*ids, eos], finish_reason="stop"))
        outputs.append(out.text)
    assert outputs == ["x", "<|im_start|>x"]


def sample(text: str, finish: str | None, index: int = 0) -> SampleOutput:
    return SampleOutput(prompt_index=0, index=index, text=text, token_ids=[], logprobs=[],
                        finish_reason=finish, stop_reason=None, num_prompt_tokens=5,
                        num_output_tokens=3, num_cached_tokens=0)


CALLS_TEXT = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
              '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": '
              '{"q": "Paris"}}\n</tool_call>')


def builder(body: dict[str, Any], n: int = 1) -> ResponseBuilder:
    _, output = tool_input(**body)
    return ResponseBuilder("chat", "chatcmpl-1", "m", None, n, tool_calls=output)


def assembled(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each choice's streamed message, put together as the openai client does."""
    choices: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            msg = choices.setdefault(c["index"], {"content": "", "tool_calls": {}})
            msg["content"] += c["delta"].get("content") or ""
            for call in c["delta"].get("tool_calls", []):
                slot = msg["tool_calls"].setdefault(call["index"], {"function": {
                    "name": "", "arguments": ""}})
                for key in ("id", "type"):
                    if key in call:
                        slot[key] = call[key]
                slot["function"]["name"] += call["function"].get("name", "")
                slot["function"]["arguments"] += call["function"]["arguments"]
            if c["finish_reason"]:
                msg["finish_reason"] = c["finish_reason"]
    return choices


@pytest.mark.parametrize("parallel", [True, False])
def test_response_whole_and_streamed(parallel: bool) -> None:
    body = {"tools": [WEATHER, SEARCH], "parallel_tool_calls": parallel}
    whole = builder(body).whole([sample(CALLS_TEXT, "stop")])["choices"][0]
    message = whole["message"]
    assert whole["finish_reason"] == "tool_calls" and message["content"] == "I will check."
    calls = message["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "search"][:1 + parallel]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    stream = builder(body)
    chunks = [chunk for i in range(0, len(CALLS_TEXT), 7)
              for chunk in stream.chunks(sample(CALLS_TEXT[i:i + 7], None))]
    chunks += stream.chunks(sample("", "stop"))
    got = assembled(chunks)[0]
    assert got["content"] == message["content"] and got["finish_reason"] == "tool_calls"
    assert [{k: v for k, v in c.items() if k != "id"} for c in got["tool_calls"].values()] == [
        {k: v for k, v in c.items() if k != "id"} for c in calls]
    assert not any("<tool" in (c["choices"][0]["delta"].get("content") or "") for c in chunks)


def test_response_without_calls_and_when_cut_short() -> None:
    body = {"tools": [WEATHER]}
    plain = builder(body).whole([sample("Just text.", "stop")])["choices"][0]
    assert plain["message"] == {"role": "assistant", "content": "Just text."}
    assert plain["finish_reason"] == "stop"
    cut = builder(body).whole([sample(CALLS_TEXT[:60], "length")])["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"]


def test_named_and_required_responses() -> None:
    named = {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                 "function": {"name": "get_weather"}}}
    whole = builder(named).whole([sample('{"city": "Rome"}', "stop")])["choices"][0]
    assert whole["message"]["content"] is None and whole["finish_reason"] == "tool_calls"
    assert whole["message"]["tool_calls"][0]["function"] == {"name": "get_weather",
                                                             "arguments": '{"city": "Rome"}'}
    stream = builder(named, n=2)
    chunks = [*stream.chunks(sample('{"city":', None, 1)), *stream.chunks(sample("", None, 0)),
              *stream.chunks(sample(' "Rome"}', "stop", 1)), *stream.chunks(sample("{}", "stop"))]
    got = assembled(chunks)
    assert got[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Rome"}'
    assert got[0]["tool_calls"][0]["function"]["arguments"] == "{}"
    required = {"tools": [WEATHER, SEARCH], "tool_choice": "required"}
    text = '[{"name": "search", "parameters": {"q": "x"}}]'
    whole = builder(required).whole([sample(text, "stop")])["choices"][0]
    assert whole["message"]["tool_calls"][0]["function"] == {"name": "search",
                                                             "arguments": '{"q": "x"}'}
