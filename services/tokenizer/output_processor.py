"""The output side of every API: scheduler token outputs in, client text outputs out.

One ``OutputProcessor`` per frontend process (and one in the offline ``LLM``) holds a
``RequestState`` per engine request: its sampling params, its ``n`` samples with their
incremental detokenizers and stop strings, and its finish state. Whoever receives the
scheduler's ``EngineOutputs`` (the engine client's receive loop; the offline engine's
step loop) hands them to ``process``, which turns each into a ``SampleOutput`` (a delta
while streaming, or the sample's whole text once it finishes otherwise) and puts it
straight into the ``sink`` of the client request the prompt belongs to: one hop, no
per-request task. A stop string ends a sample here (text cut before it unless
``include_stop_str_in_output``); ``process`` returns those samples, which the caller
aborts at the scheduler. Outputs that arrive for an ended sample (the scheduler catching
up with an abort) are ignored.

Detokenization is incremental (``IncrementalDetokenizer``), so streamed deltas
concatenated equal the final text, multi-byte characters included.

Prompt logprobs (``prompt_logprobs``) arrive once, with sample 0's first tokens; every
sample's first ``SampleOutput`` (its only one when not streaming) carries them with the
prompt's token ids, as vLLM's outputs do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.tokenizer.detokenizer import IncrementalDetokenizer
from shared.protocol import EngineOutput, TokenLogprobs
from shared.sampling_params import SamplingParams


class RequestFailed(Exception):
    """The scheduler rejected or failed a request (its typed ``RequestError``)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class SampleOutput:
    """New text of one sample (streaming), or all of it (not streaming)."""

    prompt_index: int  # which prompt of the client request
    index: int  # which of that prompt's n samples
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # empty unless the request asked for logprobs
    finish_reason: str | None  # "stop", "length", "abort"; None while running
    stop_reason: str | int | None  # the stop string, or the stop token id
    num_prompt_tokens: int
    num_output_tokens: int  # of this sample, so far
    num_cached_tokens: int
    # in each sample's first output, when the request asked prompt_logprobs: the prompt's
    # token ids and each one's logprobs (the first None)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None


OutputItem = SampleOutput | RequestFailed


class OutputSink(Protocol):
    """Where a client request's outputs go (an asyncio queue, a list, a socket outbox)."""

    def put(self, item: OutputItem) -> None: ...


@dataclass
class _Sample:
    index: int
    detok: IncrementalDetokenizer | None  # None: the model has no tokenizer (ids only)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_logprobs_sent: bool = False


class RequestState:
    """One prompt at the engine: its n samples, from token outputs to text."""

    def __init__(
        self, engine_request_id: str, prompt_index: int, params: SamplingParams,
        num_prompt_tokens: int, tokenizer: Any | None, stream: bool, sink: OutputSink,
        prompt_token_ids: Sequence[int] | None = None,  # needed with prompt_logprobs
        skip_special_tokens: bool = True,  # False: kept in the text (tool call markers)
    ) -> None:
        self.engine_request_id = engine_request_id
        self.prompt_index = prompt_index
        self.params = params
        self.stream = stream
        self.sink = sink
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self._want_logprobs = params.logprobs is not None
        self.prompt_token_ids = (list(prompt_token_ids or ())
                                 if params.prompt_logprobs is not None else None)
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None  # once they arrive
        self._skip_special = skip_special_tokens
        self.samples = [
            _Sample(i, IncrementalDetokenizer(tokenizer, params.stop,
                                              params.include_stop_str_in_output,
                                              skip_special_tokens)
                    if tokenizer is not None else None)
            for i in range(params.n)
        ]

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def absorb(self, out: EngineOutput) -> tuple[SampleOutput | None, bool]:
        """(what the client gets, if anything; whether a stop string ended the sample)."""
        if not 0 <= out.index < len(self.samples):
            return None, False  # a sample we never asked for: the scheduler's bug, drop it
        sample = self.samples[out.index]
        if sample.finish_reason is not None:
            return None, False  # ended by a stop string or an abort; late output
        if out.num_cached_tokens:
            self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.prompt_logprobs and self.prompt_token_ids is not None:
            self.prompt_logprobs = list(out.prompt_logprobs)
        start = len(sample.token_ids)
        sample.token_ids.extend(out.new_token_ids)
        if self._want_logprobs:
            sample.logprobs.extend(list(out.new_logprobs) or [None] * len(out.new_token_ids))
        text, hit = "", False
        if sample.detok is not None:
            new_ids = out.new_token_ids
            if not self._skip_special and out.finish_reason == "stop" and new_ids:
                new_ids = new_ids[:-1]  # the stop token (EOS) is no text, as vLLM's
            delta = sample.detok.push(new_ids)
            text = delta.text
            if delta.stop_string is not None:
                sample.finish_reason, sample.stop_reason = "stop", delta.stop_string
                hit = True
        if not hit and out.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            if sample.detok is not None:
                text += sample.detok.finish().text  # the held-back tail, if any
        if self.stream:
            return self._output(sample, text, start), hit
        if sample.finish_reason is not None:
            return self._final(sample), hit
        return None, hit

    def end_unfinished(
        self, indices: Sequence[int] | None = None, reason: str = "abort"
    ) -> list[SampleOutput]:
        """End running samples (all, or ``indices``) here; their last outputs."""
        outputs = []
        for sample in self.samples:
            if sample.finish_reason is not None or (indices is not None and sample.index not in indices):
                continue
            sample.finish_reason = reason
            tail = sample.detok.finish().text if sample.detok is not None else ""
            outputs.append(self._output(sample, tail, len(sample.token_ids)) if self.stream
                           else self._final(sample))
        return outputs

    def _output(self, sample: _Sample, text: str, start: int) -> SampleOutput:
        output = SampleOutput(
            prompt_index=self.prompt_index, index=sample.index, text=text,
            token_ids=sample.token_ids[start:],
            logprobs=sample.logprobs[start:] if self._want_logprobs else [],
            finish_reason=sample.finish_reason, stop_reason=sample.stop_reason,
            num_prompt_tokens=self.num_prompt_tokens, num_output_tokens=len(sample.token_ids),
            num_cached_tokens=self.num_cached_tokens,
        )
        if self.prompt_logprobs is not None and not sample.prompt_logprobs_sent:
            sample.prompt_logprobs_sent = True
            output.prompt_token_ids, output.prompt_logprobs = (self.prompt_token_ids,
                                                               self.prompt_logprobs)
        return output

    def _final(self, sample: _Sample) -> SampleOutput:
        return self._output(sample, sample.detok.text if sample.detok is not None else "", 0)


class OutputProcessor:
    """Engine request id -> RequestState, for every request this process holds."""

    def __init__(self) -> None:
        self._states: dict[str, RequestState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, engine_request_id: str) -> bool:
        return engine_request_id in self._states

    def add(self, state: RequestState) -> None:
        self._states[state.engine_request_id] = state

    def process(self, outputs: Sequence[EngineOutput]) -> list[tuple[str, int]]:
        """Route one step's outputs to their sinks; the (engine request id, sample index)
        of every sample a stop string ended, to abort at the scheduler."""
        stopped: list[tuple[str, int]] = []
        states = self._states
        for out in outputs:
            state = states.get(out.request_id)
            if state is None:
                continue  # aborted here already
            item, hit = state.absorb(out)
            if item is not None:
                state.sink.put(item)
            if hit:
                stopped.append((out.request_id, out.index))
            if state.finished:
                del states[out.request_id]
        return stopped

    def fail(self, engine_request_id: str, code: str, message: str) -> None:
        """The scheduler rejected or failed the request: its sink gets the error."""
        state = self._states.pop(engine_request_id, None)
        if state is not None:
            state.sink.put(RequestFailed(code, message))

    def fail_all(self, code: str, message: str) -> list[str]:
        """Every held request failed (the scheduler is gone); their ids."""
        ids = list(self._states)
        for engine_request_id in ids:
            self.fail(engine_request_id, code, message)
        return ids

    def end(self, engine_request_id: str, indices: Sequence[int] | None = None,
            deliver: bool = True) -> bool:
        """End samples here (a client cancel, shutdown); their final outputs go to the
        sink unless ``deliver`` is false (the client is gone). True if any sample ended."""
        state = self._states.get(engine_request_id)
        if state is None:
            return False
        ended = state.end_unfinished(indices)
        if deliver:
            for item in ended:
                state.sink.put(item)
        if state.finished:
            del self._states[engine_request_id]
        return bool(ended)
