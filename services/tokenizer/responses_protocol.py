"""Request bodies of the Responses API (``POST /v1/responses``) and what they become.

A body becomes chat turns (``input_processor.ChatTurn``, the chat API's own type, so the
chat template sees a Responses conversation exactly as the equivalent chat messages),
``SamplingParams`` and a ``ToolRequest`` for the tool calling the chat API uses:

- ``input``: a string (one user message) or a list of items: messages (role user,
  system, developer (as system) or assistant; content a string or ``input_text`` /
  ``output_text`` parts, joined by newlines as the chat API joins text parts),
  ``function_call`` items (merged into the assistant turn before them, as one chat
  message carries an answer's text and its calls) and ``function_call_output`` items
  (tool messages); ``instructions`` is a system turn in front, never carried over to a
  continuation (OpenAI's rule);
- ``tools``: Responses' flat function tools, turned into the chat shape;
  ``tool_choice`` "none", "auto", "required" or ``{"type": "function", "name"}``;
- ``text.format``: ``json_schema`` / ``json_object`` as a structured-output constraint
  (or vLLM's ``structured_outputs`` body, as on chat; not both);
- sampling: OpenAI's ``max_output_tokens``, ``temperature``, ``top_p`` and the extras
  vLLM takes on this API (``top_k``, ``seed``, ``stop``, ...), checked by ``SamplingParams``.

Unknown fields are a 400 naming them (``extra="forbid"``); fields OpenAI defines that
this server does not serve (``NOT_SERVED``) are accepted only at their "off" value, so
clients that send ``reasoning: null`` or ``background: false`` work, and anything else
is a 400 naming the field. Content parts, items and tools of other types (images,
files, reasoning items, built-in tools) are a 400 naming their type.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, ValidationError

from services.tokenizer.http_errors import bad_request
from services.tokenizer.http_protocol import (
    MAX_MESSAGES,
    RequestBody,
    StrictBody,
    StructuredOutputsBody,
    logit_bias_ids,
)
from services.tokenizer.input_processor import ChatTurn, InvalidRequest, chat_turn
from services.tokenizer.tool_calls import ToolRequest, ToolRequestError, tool_request
from shared.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams

# field -> its values that mean "not asked for" (anything else is a 400)
NOT_SERVED: dict[str, tuple[Any, ...]] = {
    "background": (None, False), "include": (None, []), "reasoning": (None,),
    "conversation": (None,), "prompt": (None,), "max_tool_calls": (None,),
    "top_logprobs": (None, 0), "service_tier": (None, "auto", "default"),
    "prompt_cache_retention": (None,), "stream_options": (None,),
    "context_management": (None, []), "truncation": (None, "disabled"),
}
MAX_METADATA, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's bounds
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}




class InputText(StrictBody):
    type: Literal["input_text"]
    text: str


class OutputText(StrictBody):
    """An assistant's text, as an earlier response's output gives it back."""

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class MessageItem(StrictBody):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]
    id: str | None = None  # as an earlier output item carries them
    status: str | None = None
    phase: str | None = None

    def text(self, where: str) -> str:
        if isinstance(self.content, str):
            return self.content
        parts: dict[str, type[StrictBody]] = {"input_text": InputText, "output_text": OutputText}
        texts = []
        for j, raw in enumerate(self.content):
            texts.append(_parse(parts, raw, f"{where}.content[{j}]", "content part").text)
        return "\n".join(texts)


class FunctionCallItem(StrictBody):
    """A call an earlier answer made (Responses' ``function_call`` output item)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictBody):
    """The result of a call, sent back by the client."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "\n".join(part.text for part in self.output)


Item = MessageItem | FunctionCallItem | FunctionCallOutputItem
ITEMS: dict[str, type[StrictBody]] = {"message": MessageItem, "function_call": FunctionCallItem,
                                  "function_call_output": FunctionCallOutputItem}


class FunctionTool(StrictBody):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # accepted; required/named calls follow the schema anyway

    def chat_shape(self) -> dict[str, Any]:
        function = self.model_dump(exclude_none=True, exclude={"type"})
        return {"type": "function", "function": function}


class TextFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None  # json_schema
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None  # accepted: the schema is always enforced


class TextConfig(StrictBody):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # a hint for other models; only the default


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    stream: bool | None = False
    max_output_tokens: int | None = None  # None: the room left after the prompt
    temperature: float | None = None
    top_p: float | None = None
    # vLLM's extra sampling fields on the Responses API
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: StructuredOutputsBody | None = None  # instead of text.format
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None  # echoed back
    user: str | None = None  # accepted, not used
    safety_identifier: str | None = None  # accepted, not used
    prompt_cache_key: str | None = None  # accepted, not used: prefix caching is automatic
    # OpenAI's fields this server does not serve (NOT_SERVED): a 400 unless "off"
    background: Any = None
    include: Any = None
    reasoning: Any = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    service_tier: Any = None
    prompt_cache_retention: Any = None
    stream_options: Any = None
    context_management: Any = None
    truncation: Any = None

    def check(self) -> None:
        """400 for a field this server does not serve, or metadata over OpenAI's bounds."""
        for name, off in NOT_SERVED.items():
            if getattr(self, name) not in off:
                raise bad_request(f"'{name}' is not supported by this server's Responses API",
                                  name)
        metadata = self.metadata or {}
        if len(metadata) > MAX_METADATA or any(
                len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in metadata.items()):
            raise bad_request(f"metadata: at most {MAX_METADATA} pairs, keys up to "
                              f"{MAX_METADATA_KEY} and values up to {MAX_METADATA_VALUE} "
                              "characters", "metadata")

    # -- the conversation -------------------------------------------------------------------
    def input_turns(self) -> list[ChatTurn]:
        """The input as chat turns (without ``instructions``)."""
        if isinstance(self.input, str):
            return [ChatTurn("user", self.input)]
        if not self.input or len(self.input) > MAX_MESSAGES:
            raise bad_request(f"input must have 1 to {MAX_MESSAGES} items", "input")
        turns: list[_Turn] = []
        for i, raw in enumerate(self.input):
            where = f"input[{i}]"
            if isinstance(raw, dict) and "type" not in raw:  # an "easy" message
                raw = {**raw, "type": "message"}
            item = _parse(ITEMS, raw, where, "input item")
            if isinstance(item, MessageItem):
                turns.append(_Turn(where, ROLES[item.role], item.text(where)))
            elif isinstance(item, FunctionCallItem):
                call = (item.call_id, item.name, item.arguments)
                if turns and turns[-1].role == "assistant":
                    turns[-1].calls.append(call)
                else:
                    turns.append(_Turn(where, "assistant", None, [call]))
            elif isinstance(item, FunctionCallOutputItem):
                turns.append(_Turn(where, "tool", item.text(), tool_call_id=item.call_id))
        try:
            return [chat_turn(t.where, t.role, t.content, t.calls, t.tool_call_id) for t in turns]
        except InvalidRequest as e:
            raise bad_request(str(e), "input") from None

    def instruction_turns(self) -> list[ChatTurn]:
        return [ChatTurn("system", self.instructions)] if self.instructions else []

    # -- sampling, structured output, tools ---------------------------------------------------
    def sampling_params(self) -> SamplingParams:
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise bad_request(f"max_output_tokens must be >= 1, got {self.max_output_tokens}",
                              "max_output_tokens")
        values: dict[str, Any] = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logit_bias": logit_bias_ids(self.logit_bias),
            "structured_outputs": self._structured_outputs(),
        }
        given = {k: v for k, v in values.items() if v is not None}
        try:
            return SamplingParams(max_tokens=self.max_output_tokens, **given)
        except SamplingParamsError as e:
            raise bad_request(str(e), e.param) from None

    def _structured_outputs(self) -> StructuredOutputsParams | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "text":
            fmt = None
        if fmt is not None and self.structured_outputs is not None:
            raise bad_request("give one of text.format and structured_outputs", "structured_outputs")
        if self.structured_outputs is not None:
            try:
                return self.structured_outputs.params()
            except SamplingParamsError as e:
                raise bad_request(f"structured_outputs: {e}", "structured_outputs") from None
        if fmt is None:
            return None
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise bad_request("text.format json_schema needs a schema", "text")
        try:
            if fmt.type == "json_object":
                return StructuredOutputsParams(json_object=True)
            return StructuredOutputsParams(json=json.dumps(fmt.schema_))
        except SamplingParamsError as e:
            raise bad_request(f"text.format: {e}", "text") from None

    def function_tools(self) -> list[FunctionTool]:
        tools = []
        for i, raw in enumerate(self.tools or ()):
            tools.append(_parse({"function": FunctionTool}, raw, f"tools[{i}]", "tool"))
        return tools

    def tool_request(self) -> ToolRequest | None:
        """The tools in the chat shape and the checked choice (None: no tools)."""
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise bad_request('tool_choice: only "none", "auto", "required" or '
                                  '{"type": "function", "name": ...} are supported', "tool_choice")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        tools = [t.chat_shape() for t in self.function_tools()]
        try:
            return tool_request(tools, choice, self.parallel_tool_calls)
        except ToolRequestError as e:
            raise bad_request(str(e), e.param) from None


@dataclass
class _Turn:
    """A chat turn being put together (an assistant turn collects its calls)."""

    where: str
    role: str
    content: str | None
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    tool_call_id: str | None = None


def _parse(kinds: dict[str, type[StrictBody]], raw: Any, where: str, what: str) -> Any:
    """``raw`` as the body its ``type`` names, or a 400 saying where and what is wrong."""
    param = where.split("[", 1)[0]
    if not isinstance(raw, dict):
        raise bad_request(f"{where}: a {what} must be an object", param)
    kind = raw.get("type")
    if kind not in kinds:
        raise bad_request(f"{where}: {what} type {str(kind)[:40]!r} is not supported by this "
                          f"server (supported: {', '.join(kinds)})", param)
    try:
        return kinds[kind].model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err.get("loc", ()))
        if err.get("type") == "extra_forbidden":
            raise bad_request(f"{where}: unsupported field '{loc}'", param) from None
        raise bad_request(f"{where}.{loc}: {err.get('msg', 'invalid')}" if loc else
                          f"{where}: {err.get('msg', 'invalid')}", param) from None
