"""Request bodies of Anthropic's Messages API and what they become (``/v1/messages``).

The bodies follow Anthropic's shapes and, like ``http_protocol``'s, forbid unknown
fields and non-finite numbers, so an unsupported parameter is a 400 naming it. A body
becomes the chat turns of ``input_processor`` (the same ``chat_turn`` checks as the chat
API) and OpenAI-shaped tools, so the chat template, ``tool_calls.ToolCalling`` and the
engine see exactly what an equivalent chat request gives them:

- ``system`` (a string or text blocks, joined by newlines) is the first, system turn;
- a user message's ``tool_result`` blocks become ``tool`` turns (``tool_call_id`` =
  ``tool_use_id``; text blocks joined; ``is_error`` prefixes ``Error: ``), its text blocks
  user turns, in their order; an assistant message's ``tool_use`` blocks become its
  ``tool_calls`` (``input`` as the arguments); ``thinking`` / ``redacted_thinking`` blocks
  of earlier assistant turns are dropped (nothing here produces or renders them);
- a final assistant message is a prefill: the answer continues its text (the chat
  template's ``continue_final_message``);
- ``tools`` ``{name, description, input_schema}`` become function tools, ``tool_choice``
  ``auto``/``any``/``tool``/``none`` OpenAI's ``auto``/``required``/a named
  function/``none``, ``disable_parallel_tool_use`` ``parallel_tool_calls: false``;
- ``output_config.format`` (a JSON schema) is a structured-output constraint, as
  ``response_format`` is on the chat API;
- ``cache_control`` is accepted anywhere Anthropic allows it and ignored (prefix caching
  is automatic), as are ``metadata``, ``service_tier``, ``output_config.effort`` and
  ``thinking`` (no thinking blocks are produced).

``max_tokens`` is a ceiling, as in Anthropic's API: one over the room the prompt leaves
in ``max_model_len`` is cut to that room (the answer then ends with
``model_context_window_exceeded``), so the prompt is tokenized first (by the input
processor, as any chat prompt) and runs as token ids.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field

from services.tokenizer.http_errors import bad_request
from services.tokenizer.http_protocol import MAX_MESSAGES, StrictBody
from services.tokenizer.input_processor import (
    ChatTurn,
    InputProcessor,
    InvalidRequest,
    PromptInput,
    chat_turn,
)
from services.tokenizer.tool_calls import (
    ToolCalling,
    ToolCallOutput,
    ToolRequest,
    ToolRequestError,
    tool_request,
)
from shared.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams

CacheControl = dict[str, Any]  # {"type": "ephemeral", "ttl": ...}: accepted, ignored
# SamplingParams' names of this API's fields
_PARAMS = {"stop": "stop_sequences", "structured_outputs": "output_config", "json": "output_config"}




class TextBlock(StrictBody):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None  # as a replayed answer carries them


class ToolUseBlock(StrictBody):
    """A call the assistant made, sent back in the history."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(StrictBody):
    """The client's answer to a ``tool_use``, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        content = self.content or ""
        text = content if isinstance(content, str) else "\n".join(b.text for b in content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(StrictBody):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(StrictBody):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type")]
BLOCK_TYPES = ("text", "tool_use", "tool_result", "thinking", "redacted_thinking")


class MessageParam(StrictBody):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class ToolParam(StrictBody):
    """A client tool; Anthropic's server tools (``web_search_...``) are not served."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None

    def openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


class ToolChoiceParam(StrictBody):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool to call
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(StrictBody):
    """Accepted, ignored: the served model's answer has no thinking blocks."""

    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class JsonOutputFormat(StrictBody):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictBody):
    """``format``: the answer is JSON of this schema (structured output); ``effort`` is
    accepted and ignored."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(StrictBody):
    user_id: str | None = None


class _Conversation(StrictBody):
    """What both endpoints take: the conversation and its tools."""

    model: str
    messages: list[MessageParam] = Field(max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # automatic caching: accepted, ignored

    def turns(self) -> list[ChatTurn]:
        if not self.messages:
            raise bad_request("messages: at least one message is required", "messages")
        turns = []
        system = self.system
        if system:
            text = system if isinstance(system, str) else "\n".join(b.text for b in system)
            turns.append(ChatTurn("system", text))
        for i, message in enumerate(self.messages):
            try:
                turns += _message_turns(f"messages[{i}]", message)
            except InvalidRequest as e:
                raise bad_request(str(e), "messages") from None
        return turns

    def tool_request(self) -> ToolRequest | None:
        tools = [t.openai() for t in self.tools or ()]
        choice, parallel = _openai_choice(self.tool_choice)
        try:
            return tool_request(tools, choice, parallel)
        except ToolRequestError as e:
            raise bad_request(str(e), e.param) from None

    def token_ids(self, processor: InputProcessor, request: ToolRequest | None) -> list[int]:
        """The prompt's token ids, as the input processor renders the conversation
        through the chat template (``request``: the tools it shows)."""
        turns = self.turns()
        prefill = turns[-1].role == "assistant"
        if prefill and (turns[-1].tool_calls or not turns[-1].content):
            raise bad_request("a final assistant message (a prefill) must have text and no "
                              "tool_use", "messages")
        chat = PromptInput(SamplingParams(max_tokens=None), messages=turns,
                           tools=list(request.tools) if request is not None else None,
                           add_generation_prompt=not prefill, continue_final_message=prefill)
        try:
            return processor.process(chat).prompt_token_ids
        except InvalidRequest as e:
            raise bad_request(str(e)) from None


class MessagesRequest(_Conversation):
    """``POST /v1/messages``."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None  # accepted, not used
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted, not used
    stream: bool | None = False

    def prompt_input(self, processor: InputProcessor,
                     calling: ToolCalling) -> tuple[PromptInput, ToolCallOutput | None, bool]:
        """The prompt as the engine runs it, what shapes its tool calls (None: the text
        is all content), and whether ``max_tokens`` was cut to the context window."""
        request = self.tool_request()
        token_ids = self.token_ids(processor, request)
        room = processor.limits.max_model_len - len(token_ids)
        # a prompt that leaves no room keeps max_tokens: the input processor refuses it
        clamped = 0 < room < self.max_tokens
        values: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p,
                                  "top_k": self.top_k, "stop": self.stop_sequences}
        output_format = self.output_config.format if self.output_config else None
        try:
            if output_format is not None:
                values["structured_outputs"] = StructuredOutputsParams(
                    json=json.dumps(output_format.schema_))
            params = SamplingParams(max_tokens=room if clamped else self.max_tokens,
                                    **{k: v for k, v in values.items() if v is not None})
        except SamplingParamsError as e:
            param = _PARAMS.get(e.param, e.param)
            raise bad_request(f"{param}: {str(e).split(': ', 1)[-1]}", param) from None
        prompt = PromptInput(params, prompt_token_ids=token_ids)
        try:
            prompt, output = calling.prepare(prompt, request)
        except ToolRequestError as e:
            raise bad_request(str(e), e.param) from None
        return prompt, output, clamped


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``: the conversation alone."""

    def num_tokens(self, processor: InputProcessor) -> int:
        return len(self.token_ids(processor, self.tool_request()))


def _openai_choice(choice: ToolChoiceParam | None) -> tuple[str | dict[str, Any] | None,
                                                            bool | None]:
    """Anthropic's tool_choice as ``tool_request`` takes it: (choice, parallel)."""
    if choice is None:
        return None, None
    if (choice.type == "tool") != (choice.name is not None):
        raise bad_request('tool_choice: "name" goes with type "tool", and only with it',
                          "tool_choice")
    parallel = None if choice.disable_parallel_tool_use is None else (
        not choice.disable_parallel_tool_use)
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"any": "required"}.get(choice.type, choice.type), parallel


def _message_turns(where: str, message: MessageParam) -> list[ChatTurn]:
    """One Anthropic message as chat turns (a user message with tool results: several)."""
    role, content = message.role, message.content
    if isinstance(content, str):
        return [chat_turn(where, role, content)]
    turns: list[ChatTurn] = []
    texts: list[str] = []
    calls: list[tuple[str, str, str]] = []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            if role != "assistant":
                raise InvalidRequest(f"{at}: tool_use blocks belong in assistant messages")
            calls.append((block.id, block.name, json.dumps(block.input, ensure_ascii=False)))
        elif isinstance(block, ToolResultBlock):
            if role != "user":
                raise InvalidRequest(f"{at}: tool_result blocks belong in user messages")
            if texts:  # text before a result stays before it
                turns.append(chat_turn(where, role, "\n".join(texts)))
                texts = []
            turns.append(chat_turn(at, "tool", block.text(), tool_call_id=block.tool_use_id))
        elif role != "assistant":  # thinking blocks: the model's own, dropped
            raise InvalidRequest(f"{at}: {block.type} blocks belong in assistant messages")
    if role == "assistant":
        text = "\n".join(texts) if texts or not calls else None
        return [chat_turn(where, role, text, calls)]
    if texts or not turns:
        turns.append(chat_turn(where, role, "\n".join(texts)))
    return turns
