"""Tool calling on the chat API: the request's tools, what ``tool_choice`` asks of the
engine, and each choice's text as OpenAI's ``tool_calls``.

- ``ToolRequest``: the ``tools`` (OpenAI function tools, bounded in number and size, names
  as OpenAI allows them), ``tool_choice`` and ``parallel_tool_calls`` of one request. The
  chat template renders the tools (whatever the choice, as vLLM does; a template that
  ignores tools renders none, see ``ToolCalling``).
- ``ToolCalling``: the server's side, one per frontend: the call format
  (``--tool-call-parser``, ``tool_parsers.select_format``) and what each choice needs:
  - ``none``: no parsing, the text is content;
  - ``auto``: the text goes through the format's parser; a 400 when the server has none;
  - ``required``: structured output holds the text to a JSON array of calls
    ``[{"name": <a tool>, "parameters": <its schema>}, ...]`` (one call unless
    ``parallel_tool_calls``), parsed as ``tool_parsers.JSON_ARRAY``;
  - a named function: structured output holds the text to that function's parameter
    schema, and the text is the call's arguments.
  ``required`` and named work with any format (``none`` included) and any template: the
  constraint, not the model's habits, makes the call (vLLM's design).
- ``ToolCallOutput``: per request, each choice's text (whole, or delta by delta) as an
  assistant message or delta with ``tool_calls``; ``finish_reason`` becomes
  ``tool_calls`` when a call was made and the sample stopped by itself.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from services.tokenizer.input_processor import PromptInput
from services.tokenizer.tool_parsers import (
    JSON_ARRAY,
    CallFormat,
    CallStream,
    NamedCallStream,
    ParsedDelta,
    ToolCallStream,
    keeps_special_tokens,
    select_format,
)
from shared.sampling_params import SamplingParamsError, StructuredOutputsParams

log = logging.getLogger("pagoda.frontend.tools")

MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOLS_CHARS = 256 * 1024  # all tool definitions together, as JSON
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")


class ToolRequestError(ValueError):
    """A request's tools or tool choice the client got wrong; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict[str, Any], ...]  # {"type": "function", "function": {...}}, as sent
    choice: str  # "none", "auto", "required", or "function" (the one named)
    function: str | None = None  # with choice "function": its name
    parallel: bool = True  # parallel_tool_calls

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def parameters(self, name: str) -> dict[str, Any]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    def constraint(self) -> StructuredOutputsParams | None:
        """The structured output that enforces ``required`` or a named function."""
        if self.choice == "function":
            assert self.function is not None
            schema = self.parameters(self.function)
        elif self.choice == "required":
            call = [{"type": "object", "properties": {
                "name": {"type": "string", "enum": [name]},
                "parameters": self.parameters(name)}, "required": ["name", "parameters"]}
                for name in self.names]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": call}}
            if not self.parallel:
                schema["maxItems"] = 1
        else:
            return None
        return StructuredOutputsParams(json=json.dumps(schema, separators=(",", ":")))


def tool_request(tools: Sequence[dict[str, Any]] | None, choice: str | dict[str, Any] | None,
                 parallel: bool | None) -> ToolRequest | None:
    """The checked tool request of a chat body (None: no tools, no tool choice)."""
    if not tools:
        if choice not in (None, "none"):
            raise ToolRequestError("tool_choice needs tools", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise ToolRequestError(f"at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    if len(json.dumps(list(tools))) > MAX_TOOLS_CHARS:
        raise ToolRequestError(f"the tools are over {MAX_TOOLS_CHARS} characters of JSON", "tools")
    names = [t["function"]["name"] for t in tools]
    for name in names:
        if not TOOL_NAME.fullmatch(name):
            raise ToolRequestError(f"tool name {name[:80]!r}: 1 to 64 letters, digits, _ or -",
                                   "tools")
    if len(set(names)) < len(names):
        raise ToolRequestError("tool names must be unique", "tools")
    function = None
    if isinstance(choice, dict):
        function = choice["function"]["name"]
        if function not in names:
            raise ToolRequestError(f"tool_choice names {function[:80]!r}, which is not one of "
                                   "the tools", "tool_choice")
        choice = "function"
    return ToolRequest(tuple(tools), choice or "auto", function, parallel is not False)


class ToolCallOutput:
    """One chat request's choices as messages or deltas with tool calls."""

    def __init__(self, new_stream: Callable[[], CallStream], parallel: bool) -> None:
        self._new_stream = new_stream
        self._parallel = parallel
        self._streams: dict[int, CallStream] = {}  # choice index -> its stream

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The whole answer: (message, finish_reason)."""
        stream = self._new_stream()
        stream.push(text)
        stream.finish()
        calls = stream.calls if self._parallel else stream.calls[:1]
        if not calls:
            return {"role": "assistant", "content": stream.content}, finish_reason
        return ({"role": "assistant", "content": stream.content or None,
                 "tool_calls": [c.as_dict() for c in calls]}, _finish(finish_reason))

    def delta(self, choice: int, text: str,
              finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """One streamed piece of a choice: (delta, finish_reason)."""
        stream = self._streams.get(choice)
        if stream is None:
            stream = self._streams[choice] = self._new_stream()
        parsed = stream.push(text)
        if finish_reason is not None:
            _extend(parsed, stream.finish())
        delta: dict[str, Any] = {}
        if parsed.content:
            delta["content"] = parsed.content
        entries = [e for e in parsed.tool_calls if self._parallel or e["index"] == 0]
        if entries:
            delta["tool_calls"] = entries
        if finish_reason is not None and stream.calls:
            finish_reason = _finish(finish_reason)
        return delta, finish_reason


def _finish(finish_reason: str | None) -> str | None:
    return "tool_calls" if finish_reason == "stop" else finish_reason


def _extend(delta: ParsedDelta, more: ParsedDelta) -> None:
    delta.content += more.content
    for entry in more.tool_calls:
        if "id" in entry:
            delta.tool_calls.append(entry)
        else:
            delta.add_arguments(entry["index"], entry["function"]["arguments"])


class ToolCalling:
    """A frontend's tool calling: its call format and what a request's tools need."""

    def __init__(self, fmt: CallFormat | None, keep_special_tokens: bool = False) -> None:
        self.fmt = fmt
        self.keep_special_tokens = keep_special_tokens

    @classmethod
    def from_setting(cls, setting: str, tokenizer: Any | None) -> ToolCalling:
        """``--tool-call-parser``'s format for this tokenizer (logged once)."""
        fmt, why = select_format(setting, tokenizer)
        keep = fmt is not None and tokenizer is not None and keeps_special_tokens(fmt, tokenizer)
        log.info("tool call parser: %s (%s)%s", fmt.name if fmt else "none", why,
                 "; special tokens kept in the text" if keep else "")
        return cls(fmt, keep)

    def prepare(self, prompt: PromptInput,
                request: ToolRequest | None) -> tuple[PromptInput, ToolCallOutput | None]:
        """The prompt as the engine must run it (a constraint for ``required`` and a named
        function; special tokens kept for a parser that needs them) and the output's
        shaper (None: the text is content)."""
        if request is None or request.choice == "none":
            return prompt, None
        names = request.names
        if request.choice == "auto":
            fmt = self.fmt
            if fmt is None:
                raise ToolRequestError(
                    'tool_choice "auto" needs a tool call parser, and this server has none '
                    "(start it with --tool-call-parser hermes, llama3_json or mistral); "
                    'tool_choice "required" or a named function work without one', "tool_choice")
            output = ToolCallOutput(lambda: ToolCallStream(fmt, names), request.parallel)
            return replace(prompt, skip_special_tokens=not self.keep_special_tokens), output
        params = prompt.sampling_params
        if params.structured_outputs is not None:
            raise ToolRequestError(f'tool_choice "{request.choice}" is enforced with structured '
                                   "output and cannot be combined with another constraint "
                                   "(response_format, structured_outputs)", "tool_choice")
        try:
            params = msgspec.structs.replace(params, structured_outputs=request.constraint())
        except SamplingParamsError as e:
            raise ToolRequestError(f"the tools as a constraint: {e}", "tools") from None
        function = request.function
        if function is not None:
            fmt_id = (self.fmt or JSON_ARRAY).new_call_id
            output = ToolCallOutput(lambda: NamedCallStream(function, fmt_id), True)
        else:
            new_id = (self.fmt or JSON_ARRAY).new_call_id
            output = ToolCallOutput(lambda: ToolCallStream(JSON_ARRAY, names, new_id),
                                    request.parallel)
        return replace(prompt, sampling_params=params), output
