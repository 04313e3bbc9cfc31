"""Anthropic Messages API responses, built from the frontend's ``SampleOutput``s.

``MessagesShape`` is the ``http_requests.ResponseShape`` of one ``/v1/messages``
request (one sample: the API has no ``n``). Whole, the answer is a ``message`` whose
``content`` is a text block (when there is text) then one ``tool_use`` block per call
(``input``: the call's arguments parsed; ``{}`` when they are not a JSON object, e.g.
cut by ``max_tokens``). Streamed, it is Anthropic's events: ``message_start`` (usage
with the input tokens), ``ping``, per block ``content_block_start`` /
``content_block_delta`` (``text_delta``; ``input_json_delta`` with the arguments' JSON
text as it grows) / ``content_block_stop``, then ``message_delta`` (stop reason, output
tokens) and ``message_stop``; an engine failure mid-stream is one ``error`` event.
Blocks open in the order the text comes, so a text that resumes after a call is a new
text block (the whole answer puts all text first).

``stop_reason``: ``end_turn`` (end of sequence, a stop token), ``stop_sequence`` (with
``stop_sequence`` the string), ``max_tokens``, ``model_context_window_exceeded`` (the
prompt left less room than ``max_tokens``, and the answer filled it), ``tool_use``
(calls made and the sample stopped by itself), ``pause_turn`` (the server aborted the
answer, e.g. while shutting down: send the conversation again to continue it).
``usage.input_tokens`` counts the whole prompt (prefix-cache hits included).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from services.tokenizer.http_errors import ApiError
from services.tokenizer.output_processor import SampleOutput
from services.tokenizer.sse import sse
from services.tokenizer.tool_calls import ToolCallOutput

_FINISH = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
           "abort": "pause_turn"}


def error_body(type_: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": type_, "message": message}}


def error_type(error: ApiError) -> tuple[int, str]:
    """(HTTP status, Anthropic error type) of an error raised as the OpenAI API's."""
    if error.code == "overloaded":
        return 529, "overloaded_error"  # Anthropic's status for "too busy, retry"
    status = error.status
    kind = {400: "invalid_request_error", 401: "authentication_error",
            403: "permission_error", 404: "not_found_error", 413: "request_too_large",
            429: "rate_limit_error", 503: "overloaded_error"}.get(status)
    if kind is None:
        return (500, "api_error") if status >= 500 else (status, "invalid_request_error")
    return status, kind


class MessagesShape:
    """The message, or its stream events, of one Messages API request."""

    def __init__(self, response_id: str, model: str, tool_calls: ToolCallOutput | None,
                 clamped: bool) -> None:
        self.response_id, self.model = response_id, model
        self._tool_calls = tool_calls  # with tools: the text parsed into calls
        self._clamped = clamped  # max_tokens was cut to the room the prompt left
        self._started = False  # message_start sent
        self._block: str | None = None  # the open block's type ("text", "tool_use")
        self._num_blocks = 0  # blocks opened so far; the open one is the last

    # -- whole ---------------------------------------------------------------------------
    def whole(self, outputs: Sequence[SampleOutput]) -> dict[str, Any]:
        out = outputs[0]
        content: list[dict[str, Any]] = []
        finish: str | None = out.finish_reason
        text: str | None = out.text
        calls: list[dict[str, Any]] = []
        if self._tool_calls is not None:
            message, finish = self._tool_calls.message(out.text, finish)
            text, calls = message["content"], message.get("tool_calls", [])
        if text:
            content.append({"type": "text", "text": text})
        content += [_tool_use(c["id"], c["function"]["name"], _input(c["function"]["arguments"]))
                    for c in calls]
        stop_reason, stop_sequence = self._stop(out, finish)
        return {**self._message(content, stop_reason, stop_sequence),
                "usage": _usage(out)}

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None,
                 stop_sequence: str | None) -> dict[str, Any]:
        return {"id": self.response_id, "type": "message", "role": "assistant",
                "model": self.model, "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence}

    def _stop(self, out: SampleOutput, finish: str | None) -> tuple[str | None, str | None]:
        if finish == "stop" and isinstance(out.stop_reason, str):
            return "stop_sequence", out.stop_reason
        if finish == "length" and self._clamped:
            return "model_context_window_exceeded", None
        return (None if finish is None else _FINISH.get(finish, "end_turn")), None

    # -- streamed ------------------------------------------------------------------------
    def events(self, out: SampleOutput) -> list[str]:
        events: list[str] = []
        if not self._started:
            self._started = True
            start = {**self._message([], None, None),
                     "usage": {"input_tokens": out.num_prompt_tokens, "output_tokens": 0}}
            events += [sse({"type": "message_start", "message": start}, "message_start"),
                       sse({"type": "ping"}, "ping")]
        finish = out.finish_reason
        if self._tool_calls is None:
            if out.text:
                events += self._text(out.text)
        else:
            delta, finish = self._tool_calls.delta(0, out.text, finish)
            if delta.get("content"):
                events += self._text(delta["content"])
            for entry in delta.get("tool_calls", ()):
                events += self._tool_piece(entry)
        if finish is not None:
            events += self._close()
            stop_reason, stop_sequence = self._stop(out, finish)
            events.append(sse({"type": "message_delta",
                               "delta": {"stop_reason": stop_reason,
                                         "stop_sequence": stop_sequence},
                               "usage": _usage(out)}, "message_delta"))
        return events

    def closing_events(self) -> list[str]:
        return [sse({"type": "message_stop"}, "message_stop")]

    def error_events(self, error: ApiError) -> list[str]:
        return [sse(error_body(error_type(error)[1], error.message), "error")]

    def _text(self, text: str) -> list[str]:
        events = [] if self._block == "text" else self._open({"type": "text", "text": ""})
        return [*events, self._delta({"type": "text_delta", "text": text})]

    def _tool_piece(self, entry: dict[str, Any]) -> list[str]:
        """One OpenAI ``delta.tool_calls`` entry: a call's start (id, name, maybe the
        first arguments), or more of its arguments; calls come one after the other."""
        events = []
        function = entry["function"]
        if "id" in entry:
            events += self._open(_tool_use(entry["id"], function["name"], {}))
        if function.get("arguments"):
            events.append(self._delta({"type": "input_json_delta",
                                       "partial_json": function["arguments"]}))
        return events

    def _open(self, block: dict[str, Any]) -> list[str]:
        events = self._close()
        self._block = block["type"]
        self._num_blocks += 1
        events.append(sse({"type": "content_block_start", "index": self._num_blocks - 1,
                           "content_block": block}, "content_block_start"))
        return events

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse({"type": "content_block_delta", "index": self._num_blocks - 1,
                    "delta": delta}, "content_block_delta")

    def _close(self) -> list[str]:
        if self._block is None:
            return []
        self._block = None
        return [sse({"type": "content_block_stop", "index": self._num_blocks - 1},
                    "content_block_stop")]


def _tool_use(call_id: str, name: str, input_: dict[str, Any]) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": input_}


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(out: SampleOutput) -> dict[str, int]:
    return {"input_tokens": out.num_prompt_tokens, "output_tokens": out.num_output_tokens}
