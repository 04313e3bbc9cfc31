"""Request bodies of the HTTP API (OpenAI's shapes, vLLM's extras) and what they become.

Every body forbids unknown fields, so a parameter we do not implement (``suffix``,
``functions``, ...) is a 400 naming it, never silently ignored; non-finite
numbers (JSON ``NaN``/``Infinity``) are refused. A body becomes one ``PromptInput`` (the
frontend's own type, not a wire message) per prompt with one ``SamplingParams``; the range checks are ``SamplingParams``'s own,
so the HTTP API, the native API and the scheduler agree on what is valid.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.tokenizer.http_errors import ApiError, bad_request
from services.tokenizer.input_processor import ChatTurn, InvalidRequest, PromptInput, chat_turn
from services.tokenizer.tool_calls import (
    ToolCalling,
    ToolCallOutput,
    ToolRequestError,
    tool_request,
)
from shared.sampling_params import (
    MAX_LOGPROBS,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)

MAX_PROMPTS = 256  # prompts in one completions request
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default; chat defaults to the room left


MAX_MESSAGES = 2048  # messages in one chat request


class StrictBody(BaseModel):
    """The base of every HTTP API body (OpenAI's, the Responses API's, Anthropic's):
    unknown fields refused, no NaN/Infinity, and strict types: no "10" -> 10, true -> 1
    or 2.0 -> 2 (an int where a float goes is fine)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """Where in parsed JSON a string (or key) holds a lone surrogate (JSON's ``"\\ud800"``
    parses, but is no text: it cannot be encoded, tokenized or sent), or None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if lone_surrogate_at(key, "") is not None:
                return path or "body"
            if (found := lone_surrogate_at(item, where)) is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if (found := lone_surrogate_at(item, f"{path}[{i}]")) is not None:
                return found
    return None


def check_text(data: Any) -> None:
    """A 400 naming the field if parsed JSON holds a lone surrogate anywhere (an
    ``ApiError``, so no error message ever echoes it: it could not be encoded)."""
    where = lone_surrogate_at(data)
    if where is not None:
        raise bad_request(f"{where}: contains a lone surrogate (\\ud800-\\udfff), which "
                          "is not text", where.split(".")[0].split("[")[0])


class RequestBody(StrictBody):
    """A whole request body: every string in it must be text (no lone surrogates)."""

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        # an ApiError, not a ValueError: pydantic passes it through to the handler
        check_text(data)
        return data


class StreamOptions(StrictBody):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage on every chunk too


class JsonSchemaFormat(StrictBody):
    """OpenAI's ``response_format.json_schema``; ``strict`` is accepted: the schema is
    always enforced."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(StrictBody):
    """vLLM's ``structured_outputs`` extra body: exactly one of these."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def params(self) -> StructuredOutputsParams:
        schema = self.json_ if self.json_ is None or isinstance(self.json_, str) else (
            json.dumps(self.json_))
        return StructuredOutputsParams(json=schema, regex=self.regex, choice=self.choice,
                                       grammar=self.grammar, json_object=bool(self.json_object))


class _Sampling(RequestBody):
    """The parameters both generation endpoints take; None means the default."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    return_tokens_as_token_ids: bool | None = None  # vLLM: logprobs name "token_id:<id>"
    user: str | None = None  # accepted (OpenAI clients send it), not used
    # vLLM's extensions
    return_token_ids: bool | None = None  # prompt_token_ids and token_ids in the response
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: all that fit)
    add_special_tokens: bool | None = None  # None: yes for completions, no for chat
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None  # False: special tokens stay in the text
    # SGLang's extras, which its model gateway adds to every request it forwards
    no_stop_trim: bool | None = None  # true: the stop string stays in the text
    return_hidden_states: bool | None = None  # false only (hidden states are not served)
    separate_reasoning: bool | None = None  # accepted: no reasoning parser, nothing to split
    stream_reasoning: bool | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs, or one of the
    # guided_* names vLLM had until 0.12 (accepted for older clients); at most one of them
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options
                                           and self.stream_options.continuous_usage_stats)

    def _prompt_options(self) -> dict[str, Any]:
        """PromptInput's fields this body sets (None: the default)."""
        options: dict[str, Any] = {"add_special_tokens": self.add_special_tokens}
        if self.skip_special_tokens is not None:
            options["skip_special_tokens"] = self.skip_special_tokens
        return options

    def _params(self, max_tokens: int | None, logprobs: int | None,
                **extra: Any) -> SamplingParams:
        values = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "min_p": self.min_p, "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens, "logprobs": logprobs,
            "logit_bias": logit_bias_ids(self.logit_bias),
            "structured_outputs": self._structured_outputs(),
            "truncate_prompt_tokens": self.truncate_prompt_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output or self.no_stop_trim,
            **extra,
        }
        given = {k: v for k, v in values.items() if v is not None}
        if self.stop is not None:
            given["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.return_hidden_states:
            raise bad_request("return_hidden_states is not supported", "return_hidden_states")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        try:
            return SamplingParams(max_tokens=max_tokens, **given)
        except SamplingParamsError as e:
            raise bad_request(str(e), e.param) from None


    def _structured_outputs(self) -> StructuredOutputsParams | None:
        """The one constraint the body asks for (None: free text); 400 for several."""
        given: dict[str, dict[str, Any] | StructuredOutputsBody] = {}
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given["response_format"] = {"json_object": True}
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request("response_format json_schema needs json_schema.schema",
                                  "response_format")
            given["response_format"] = {"json": rf.json_schema.schema_}
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                given[name] = {name.removeprefix("guided_"): getattr(self, name)}
        if len(given) > 1:
            names = list(given)
            raise bad_request(f"give one way of structuring the output, got {', '.join(names)}",
                              names[1])
        for name, value in given.items():
            try:
                return (value.params() if isinstance(value, StructuredOutputsBody)
                        else StructuredOutputsParams(**value))
            except SamplingParamsError as e:
                raise bad_request(str(e) if e.param == name else f"{name}: {e}", name) from None
        return None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None  # vLLM 0.x: best_of samples, the n most likely returned

    def sampling_params(self) -> SamplingParams:
        """What the engine runs: with ``best_of`` > n, ``best_of`` samples (with their
        logprobs, to rank them); with ``echo`` and ``logprobs``, prompt logprobs too."""
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        if max_tokens == 0:
            if not self.echo:
                raise bad_request("max_tokens 0 needs echo: true (scoring the prompt)",
                                  "max_tokens")
            max_tokens = 1  # the engine samples one token, which the response leaves out
        prompt_logprobs = self.logprobs if self.echo else None
        params = self._params(max_tokens, self.logprobs, prompt_logprobs=prompt_logprobs)
        if self.best_of is None or self.best_of == params.n:
            return params
        if self.best_of < params.n:
            raise bad_request(f"best_of ({self.best_of}) must be >= n ({params.n})", "best_of")
        if self.stream:
            raise bad_request("best_of > n is not supported with stream: true (the best "
                              "samples are known only at the end)", "best_of")
        if params.is_greedy:
            raise bad_request("best_of > n needs temperature > 0 (greedy samples are all "
                              "the same)", "best_of")
        try:
            return msgspec.structs.replace(params, n=self.best_of, logprobs=params.logprobs or 0)
        except SamplingParamsError as e:
            raise bad_request(str(e).replace("n:", "best_of:", 1), "best_of") from None

    @property
    def generates(self) -> bool:
        """False for ``echo`` with ``max_tokens: 0``: the answer is the prompt alone."""
        return self.max_tokens != 0

    @property
    def num_choices(self) -> int:
        """Choices per prompt in the response (n; best_of only widens what runs)."""
        return 1 if self.n is None else self.n

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif not p:
            raise bad_request("prompt must not be empty", "prompt")
        elif all(isinstance(x, int) for x in p):
            prompts = [list(p)]  # type: ignore[arg-type]
        else:
            prompts = list(p)  # type: ignore[arg-type]
        if len(prompts) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}",
                              "prompt")
        return prompts

    def prompt_inputs(self) -> list[PromptInput]:
        params = self.sampling_params()
        return [PromptInput(params, prompt=p if isinstance(p, str) else None,
                            prompt_token_ids=None if isinstance(p, str) else p,
                            **self._prompt_options())
                for p in self.prompts()]


class TextPart(StrictBody):
    type: Literal["text"]
    text: str


class FunctionBody(StrictBody):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None  # accepted; required/named calls follow the schema anyway


class ToolBody(StrictBody):
    type: Literal["function"]
    function: FunctionBody


class NamedFunction(StrictBody):
    name: str


class ToolChoiceBody(StrictBody):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(StrictBody):
    name: str
    arguments: str  # JSON text, as OpenAI returns it


class ToolCallBody(StrictBody):
    """A call an assistant message made, sent back in the history."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessageBody(StrictBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]  # OpenAI's roles
    content: str | list[TextPart] | None = None  # None: an assistant turn with tool_calls
    tool_calls: list[ToolCallBody] | None = None  # role "assistant"
    tool_call_id: str | None = None  # role "tool": the call this answers
    name: str | None = None

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def turn(self, i: int) -> ChatTurn:
        calls = [(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ()]
        try:
            return chat_turn(f"messages[{i}]", self.role, self.text(), calls, self.tool_call_id,
                             self.name)
        except InvalidRequest as e:
            raise bad_request(str(e), "messages") from None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageBody] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[ToolBody] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceBody | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat extensions
    echo: bool | None = False  # the answer starts with the last message, if the assistant's
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued
    chat_template_kwargs: dict[str, Any] | None = None

    def echo_text(self) -> str:
        """What ``echo`` puts before the answer: the last message's text when it is the
        assistant's (the role of the answer), else nothing (vLLM's rule)."""
        if not self.echo or not self.messages or self.messages[-1].role != "assistant":
            return ""
        return self.messages[-1].text() or ""

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                              f"{self.top_logprobs}", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens  # None: the room left after the prompt
        return self._params(max_tokens, logprobs)

    def prompt_input(self) -> PromptInput:
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")
        return PromptInput(self.sampling_params(), messages=chat_turns(self.messages),
                           tools=template_tools(self.tools),
                           add_generation_prompt=self.add_generation_prompt,
                           continue_final_message=self.continue_final_message,
                           chat_template_kwargs=self.chat_template_kwargs,
                           **self._prompt_options())

    def tool_input(self, calling: ToolCalling) -> tuple[PromptInput, ToolCallOutput | None]:
        """The prompt as the engine runs it under ``tool_choice``, and what turns its
        output into tool calls (None: the text is content)."""
        choice = self.tool_choice
        named = choice.model_dump() if isinstance(choice, ToolChoiceBody) else choice
        try:
            request = tool_request(template_tools(self.tools), named, self.parallel_tool_calls)
            return calling.prepare(self.prompt_input(), request)
        except ToolRequestError as e:
            raise bad_request(str(e), e.param) from None


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize: a prompt, or chat messages through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = Field(default=None, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    tools: list[ToolBody] | None = None  # rendered by the chat template, as in chat requests
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # None: yes for a prompt, no for messages
    return_token_strs: bool | None = False  # each token's string, as the tokenizer names it


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's JSON keys are token ids as strings; SamplingParams checks the bounds."""
    if bias is None:
        return None
    try:
        return {int(key): value for key, value in bias.items()}
    except ValueError:
        raise bad_request("logit_bias keys must be token ids (integers)", "logit_bias") from None


def chat_turns(messages: list[ChatMessageBody]) -> list[ChatTurn]:
    return [m.turn(i) for i, m in enumerate(messages)]


def template_tools(tools: list[ToolBody] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template gets them (OpenAI's shape; bounds checked)."""
    if not tools:
        return None
    dicts = [t.model_dump(exclude_none=True) for t in tools]
    try:
        tool_request(dicts, None, None)
    except ToolRequestError as e:
        raise bad_request(str(e), e.param) from None
    return dicts


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


def check_model(requested: str | None, served: list[str]) -> None:
    """404 unless the body names a model this server serves (or names none)."""
    if requested is not None and requested not in served:
        raise ApiError(404, f"the model '{requested}' does not exist; this server serves "
                       f"'{served[0]}'", param="model", code="model_not_found")
