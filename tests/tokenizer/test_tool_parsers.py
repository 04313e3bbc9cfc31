"""The tool call parsers on fixed texts: whole, and split into arbitrary streaming chunks.

The property every format keeps: the streamed deltas concatenated (content, and each
call's id, name and arguments) equal the whole text's result, however the text is split,
malformed texts included; a text with no call is all content, unchanged.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from typing import Any

import pytest

from services.tokenizer.tool_parsers import (
    FORMATS,
    HERMES,
    JSON_ARRAY,
    LLAMA3_JSON,
    MISTRAL,
    CallFormat,
    NamedCallStream,
    ToolCallStream,
    detect_format,
    keeps_special_tokens,
    parse_tool_calls,
    select_format,
)

NAMES = {"get_weather", "search", "f", "g"}


@dataclass
class Result:
    content: str
    calls: list[tuple[str, str, str]]  # (id, name, arguments)


def ids() -> Any:
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


def streamed(fmt: CallFormat, text: str, cuts: list[int]) -> Result:
    """``text`` pushed in pieces ending at ``cuts``; the deltas reassembled."""
    stream = ToolCallStream(fmt, NAMES, ids())
    deltas, start = [], 0
    for cut in [*sorted(cuts), len(text)]:
        deltas.append(stream.push(text[start:cut]))
        start = max(start, cut)
    deltas.append(stream.finish())
    content = "".join(d.content for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for entry in d.tool_calls:
            if "id" in entry:
                assert entry["index"] not in calls and entry["index"] == len(calls)
                assert entry["type"] == "function"
                calls[entry["index"]] = [entry["id"], entry["function"]["name"], ""]
            calls[entry["index"]][2] += entry["function"]["arguments"]
    assert content == stream.content
    return Result(content, [tuple(calls[i]) for i in sorted(calls)])  # type: ignore[misc]


def whole(fmt: CallFormat, text: str) -> Result:
    content, calls = parse_tool_calls(fmt, text, NAMES, ids())
    return Result(content, [(c.id, c.name, c.arguments) for c in calls])


def assert_chunking_invariant(fmt: CallFormat, text: str, trials: int = 200) -> Result:
    expected = whole(fmt, text)
    rng = random.Random(text)
    for trial in range(trials):
        if trial < len(text):  # every single cut first, then random ones
            cuts = [trial]
        else:
            cuts = [rng.randrange(len(text) + 1) for _ in range(rng.randint(1, len(text)))]
        assert streamed(fmt, text, cuts) == expected, (fmt.name, text, cuts)
    assert streamed(fmt, text, list(range(len(text)))) == expected  # one char at a time
    if not expected.calls:
        assert expected.content == text
    return expected


WEATHER = '{"city": "Paris", "unit": "c\\"elsius\\\\"}'
CASES: list[tuple[CallFormat, str, str, list[tuple[str, str]]]] = [
    # (format, text, content, [(name, arguments)])
    (HERMES, f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     "", [("get_weather", WEATHER)]),
    (HERMES, ('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}\n'
     '</tool_call>\n<tool_call>\n{"arguments": {}, "name": "g"}\n</tool_call>\n'),
     "Let me look.", [("f", '{"a": [1, {"b": "}"}]}'), ("g", "{}")]),
    (HERMES, '<tool_call>{"name": "search"}</tool_call> and then some text',
     " and then some text", [("search", "{}")]),
    (HERMES, 'a <tool_call> is how I call tools', "a <tool_call> is how I call tools", []),
    (HERMES, '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "unknown_tool", "arguments": {}}\n</tool_call>', []),
    (HERMES, "ends with <tool_ca", "ends with <tool_ca", []),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"q": "trunc', "",
     [("f", '{"q": "trunc')]),  # cut off by max_tokens: the call keeps what it has
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"x": 1}} oops</tool_call>', " oops</tool_call>",
     [("f", '{"x": 1}')]),
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     "", [("get_weather", '{"city": "Oslo"}')]),
    (LLAMA3_JSON, ('<|python_tag|>{"name": "f", "parameters": {"s": "a;b"}}; {"name": "g", '
     '"parameters": {"n": -1.5e3}}'), "", [("f", '{"s": "a;b"}'), ("g", '{"n": -1.5e3}')]),
    (LLAMA3_JSON, '{"name": "Ada", "born": 1815}', '{"name": "Ada", "born": 1815}', []),
    (LLAMA3_JSON, 'The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
    (LLAMA3_JSON, '{"name": "f", "parameters": 7}', "", [("f", "7")]),
    (MISTRAL, ('[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": '
     '{"b": true}, "id": "abcdefghi"}]'), "", [("f", '{"a": 1}'), ("g", '{"b": true}')]),
    (MISTRAL, 'Sure. [TOOL_CALLS][{"name": "search", "arguments": {"q": "[x]"}}]', "Sure.",
     [("search", '{"q": "[x]"}')]),
    (MISTRAL, "[TOOL_CALLS] no json here", "[TOOL_CALLS] no json here", []),
    # Mistral's v11 format: name[ARGS]arguments, a marker per call
    (MISTRAL, f'[TOOL_CALLS]get_weather[ARGS]{WEATHER}', "", [("get_weather", WEATHER)]),
    (MISTRAL, ('Two calls.[TOOL_CALLS]f[ARGS]{"a": [1, "]"]}[TOOL_CALLS]g[ARGS] {}\n'),
     "Two calls.", [("f", '{"a": [1, "]"]}'), ("g", "{}")]),
    (MISTRAL, '[TOOL_CALLS]search[ARGS]{"q": "cut', "", [("search", '{"q": "cut')]),
    (MISTRAL, '[TOOL_CALLS]unknown[ARGS]{}', '[TOOL_CALLS]unknown[ARGS]{}', []),
    (MISTRAL, '[TOOL_CALLS]f{"a": 1}', '[TOOL_CALLS]f{"a": 1}', []),
    (MISTRAL, '[TOOL_CALLS]f[ARGS]{"a": 1} and after', " and after", [("f", '{"a": 1}')]),
    (JSON_ARRAY, '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]', "",
     [("f", '{"a": 1}'), ("g", "{}")]),
    (JSON_ARRAY, '  [ {"name":"search","parameters":{"q":"\\u00e9t\\u00e9"}} ]', "",
     [("search", '{"q":"\\u00e9t\\u00e9"}')]),
    (HERMES, "No tools needed.\n\n", "No tools needed.\n\n", []),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CASES)
def test_parsers_whole_and_streamed(fmt: CallFormat, text: str, content: str,
                                    calls: list[tuple[str, str]]) -> None:
    got = assert_chunking_invariant(fmt, text)
    assert got.content == content
    assert [(name, args) for _, name, args in got.calls] == calls
    assert [i for i, _, _ in got.calls] == [f"id{k}" for k in range(len(calls))]


def test_arguments_are_the_models_json() -> None:
    """Valid JSON in, the same JSON out (a client json.loads it), escapes included."""
    args = {"text": 'quote " backslash \\ newline \n tab \t unicode é 💡', "n": [1, 2.5, None]}
    text = f'<tool_call>\n{{"name": "f", "arguments": {json.dumps(args)}}}\n</tool_call>'
    (_, _, got), = assert_chunking_invariant(HERMES, text).calls
    assert json.loads(got) == args


def test_malformed_texts_still_stream_as_they_parse_whole() -> None:
    """Random edits of well-formed texts: whatever they parse to, chunking never changes it."""
    rng = random.Random(0)
    bases = [(fmt, text) for fmt, text, _, calls in CASES if calls]
    for _ in range(150):
        fmt, text = rng.choice(bases)
        chars = list(text)
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(len(chars) + 1)
            if rng.random() < 0.5 and chars:
                del chars[min(pos, len(chars) - 1)]
            else:
                chars.insert(pos, rng.choice(' \n{}[]":,;\\afn<>/'))
        assert_chunking_invariant(fmt, "".join(chars), trials=20)


def test_long_arguments_stream_in_linear_time() -> None:
    args = json.dumps({"code": "print('x')\n" * 3000, "rows": [{"a": i} for i in range(2000)]})
    text = f'<tool_call>\n{{"name": "f", "arguments": {args}}}\n</tool_call>'
    stream = ToolCallStream(HERMES, NAMES, ids())
    pieces = [stream.push(text[i:i + 3]) for i in range(0, len(text), 3)]
    pieces.append(stream.finish())
    assert "".join(e["function"]["arguments"] for p in pieces for e in p.tool_calls) == args


def test_named_function_stream() -> None:
    stream = NamedCallStream("f", ids())
    first, second, last = stream.push(""), stream.push('{"a": '), stream.push("1}")
    assert first.tool_calls == [{"index": 0, "id": "id0", "type": "function",
                                 "function": {"name": "f", "arguments": ""}}]
    assert second.tool_calls[0]["function"]["arguments"] + last.tool_calls[0]["function"][
        "arguments"] == '{"a": 1}'
    assert stream.finish().tool_calls == [] and stream.calls[0].arguments == '{"a": 1}'
    empty = NamedCallStream("g", ids())
    empty.finish()
    assert empty.calls[0].arguments == "{}"


def test_call_ids() -> None:
    assert HERMES.new_call_id().startswith("call_") and len(HERMES.new_call_id()) == 29
    mistral = MISTRAL.new_call_id()
    assert len(mistral) == 9 and mistral.isalnum()  # Mistral's templates insist on 9


class FakeToken:
    def __init__(self, content: str, special: bool) -> None:
        self.content, self.special = content, special


class FakeTokenizer:
    def __init__(self, template: Any, special: tuple[str, ...] = ()) -> None:
        self.chat_template = template
        self.all_special_tokens = ["</s>"]
        self.added_tokens_decoder = {i: FakeToken(t, True) for i, t in enumerate(special)}


def test_auto_detection_from_the_template() -> None:
    assert detect_format("... <tool_call>\\n{{ tool_call | tojson }}")[0] is HERMES
    assert detect_format("{{ '[AVAILABLE_TOOLS]' }} ... [TOOL_CALLS]")[0] is MISTRAL
    assert detect_format("{{- '<|python_tag|>' + tool_call.name }}")[0] is LLAMA3_JSON
    assert detect_format("{% for m in messages %}{{ m.content }}{% endfor %}")[0] is None
    multi = FakeTokenizer({"default": "plain", "tool_use": "<tool_call>"})
    assert select_format("auto", multi)[0] is HERMES  # named templates: all of them are read
    assert select_format("none", multi)[0] is None
    assert select_format("mistral", FakeTokenizer(None))[0] is MISTRAL
    assert set(FORMATS) == {"hermes", "llama3_json", "mistral"}


def test_special_marker_tokens_keep_special_tokens_in_the_text() -> None:
    assert keeps_special_tokens(MISTRAL, FakeTokenizer("", ("[TOOL_CALLS]",)))
    assert keeps_special_tokens(LLAMA3_JSON, FakeTokenizer("", ("<|python_tag|>",)))
    assert not keeps_special_tokens(HERMES, FakeTokenizer("", ("[TOOL_CALLS]",)))
