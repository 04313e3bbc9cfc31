"""Request bodies of the HTTP API (OpenAI's shapes, vLLM's extras) and what they become.

Every body forbids unknown fields, so a parameter we do not implement (``suffix``,
``logit_bias``, ``tools``, ...) is a 400 naming it, never silently ignored; non-finite
numbers (JSON ``NaN``/``Infinity``) are refused. A body becomes one ``PromptInput`` (the
frontend's own type, not a wire message) per prompt with one ``SamplingParams``; the range checks are ``SamplingParams``'s own,
so the HTTP API, the native API and the scheduler agree on what is valid.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from services.tokenizer.http_errors import ApiError, bad_request
from services.tokenizer.input_processor import ChatTurn, PromptInput
from shared.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError

MAX_PROMPTS = 256  # prompts in one completions request
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default; chat defaults to the room left


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool | None = False


class _Sampling(_Body):
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
    user: str | None = None  # accepted (OpenAI clients send it), not used
    stream: bool | None = False
    stream_options: StreamOptions | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def _params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        values = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": self.top_k, "min_p": self.min_p, "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens, "logprobs": logprobs,
        }
        given = {k: v for k, v in values.items() if v is not None}
        if self.stop is not None:
            given["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        try:
            return SamplingParams(max_tokens=max_tokens, **given)
        except SamplingParamsError as e:
            raise bad_request(str(e), e.param) from None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = None

    def sampling_params(self) -> SamplingParams:
        if self.logprobs is not None and self.echo:
            raise bad_request("echo with logprobs is not supported (no prompt logprobs)",
                              "logprobs")
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return self._params(max_tokens, self.logprobs)

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
                            prompt_token_ids=None if isinstance(p, str) else p)
                for p in self.prompts()]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessageBody(_Body):
    role: str
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessageBody]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None

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
        return PromptInput(self.sampling_params(), messages=chat_turns(self.messages))


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a prompt, or chat messages through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = None
    add_generation_prompt: bool = True


def chat_turns(messages: list[ChatMessageBody]) -> list[ChatTurn]:
    return [ChatTurn(m.role, m.text()) for m in messages]


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def check_model(requested: str | None, served: list[str]) -> None:
    """404 unless the body names a model this server serves (or names none)."""
    if requested is not None and requested not in served:
        raise ApiError(404, f"the model '{requested}' does not exist; this server serves "
                       f"'{served[0]}'", param="model", code="model_not_found")
