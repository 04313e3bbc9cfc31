"""What the offline engine returns: one RequestOutput per prompt, shaped like vLLM's."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.protocol import TokenLogprobs


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort"
    logprobs: list[TokenLogprobs | None] | None = None
    # the stop string or stop token id that ended it, if any
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: one entry per prompt token, the first None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
