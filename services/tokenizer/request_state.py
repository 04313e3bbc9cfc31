"""The frontend's output side: one client request's samples, from token outputs to text.

``RequestState.absorb`` takes a scheduler ``RequestOutput`` (the new tokens of one
sample in one step) and returns what goes back to the client as a ``GenerateOutput``:
a delta while streaming, or the sample's whole text once it finishes otherwise.
Detokenization is incremental (``IncrementalDetokenizer``), so streamed deltas
concatenated equal the final text, multi-byte characters included. A stop string ends
a sample here (text cut before it unless ``include_stop_str_in_output``); the caller
must then abort that sample at the scheduler (``absorb`` says so). Outputs that arrive
for a sample after it ended (the scheduler catching up with that abort) are ignored.

The native API uses this; the HTTP API (a later issue) reuses it unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.tokenizer.detokenizer import IncrementalDetokenizer
from shared.protocol import GenerateOutput, RequestOutput, TokenLogprobs
from shared.sampling_params import SamplingParams


@dataclass
class _Sample:
    index: int
    detok: IncrementalDetokenizer | None  # None: the model has no tokenizer (ids only)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None


@dataclass
class Absorbed:
    output: GenerateOutput | None  # what to send the client, if anything
    stop_string_hit: bool = False  # the sample ended on a stop string: abort it upstream


class RequestState:
    """One request of one client: its n samples and the ids on both links."""

    def __init__(
        self,
        client_request_id: str,
        engine_request_id: str,
        params: SamplingParams,
        num_prompt_tokens: int,
        tokenizer: Any | None,
        stream: bool,
    ) -> None:
        self.client_request_id = client_request_id
        self.engine_request_id = engine_request_id
        self.params = params
        self.stream = stream
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self._want_logprobs = params.logprobs is not None
        self.samples = [
            _Sample(i, IncrementalDetokenizer(tokenizer, params.stop,
                                              params.include_stop_str_in_output)
                    if tokenizer is not None else None)
            for i in range(params.n)
        ]

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)

    def absorb(self, out: RequestOutput) -> Absorbed:
        if not 0 <= out.index < len(self.samples):
            return Absorbed(None)  # a sample we never asked for: the scheduler's bug, drop it
        sample = self.samples[out.index]
        if sample.finish_reason is not None:
            return Absorbed(None)  # ended by a stop string or an abort; late output
        if out.num_cached_tokens:
            self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        start = len(sample.token_ids)
        sample.token_ids.extend(out.new_token_ids)
        if self._want_logprobs:
            new_lp = list(out.new_logprobs) or [None] * len(out.new_token_ids)
            sample.logprobs.extend(new_lp)
        text, hit = "", False
        if sample.detok is not None:
            delta = sample.detok.push(out.new_token_ids)
            text = delta.text
            if delta.stop_string is not None:
                sample.finish_reason, sample.stop_reason = "stop", delta.stop_string
                hit = True
        if not hit and out.finish_reason is not None:
            sample.finish_reason = out.finish_reason
            sample.stop_reason = None if out.stop_reason is None else str(out.stop_reason)
            if sample.detok is not None:
                text += sample.detok.finish().text  # the held-back tail, if any
        if self.stream:
            return Absorbed(self._output(sample, text, start), hit)
        if sample.finish_reason is not None:
            return Absorbed(self._final(sample), hit)
        return Absorbed(None, hit)

    def abort_unfinished(
        self, indices: Sequence[int] | None = None, reason: str = "abort"
    ) -> list[GenerateOutput]:
        """End running samples (all, or ``indices``): client cancel or shutdown.

        Returns each ended sample's last output for the client.
        """
        outputs = []
        for sample in self.samples:
            if indices is not None and sample.index not in indices:
                continue
            if sample.finish_reason is None:
                sample.finish_reason = reason
                if self.stream:
                    tail = sample.detok.finish().text if sample.detok is not None else ""
                    outputs.append(self._output(sample, tail, len(sample.token_ids)))
                else:
                    if sample.detok is not None:
                        sample.detok.finish()
                    outputs.append(self._final(sample))
        return outputs

    def _output(self, sample: _Sample, text: str, start: int) -> GenerateOutput:
        return GenerateOutput(
            request_id=self.client_request_id,
            index=sample.index,
            text=text,
            token_ids=sample.token_ids[start:],
            logprobs=sample.logprobs[start:] if self._want_logprobs else [],
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=len(sample.token_ids),
            num_cached_tokens=self.num_cached_tokens,
        )

    def _final(self, sample: _Sample) -> GenerateOutput:
        full = sample.detok.text if sample.detok is not None else ""
        return self._output(sample, full, 0)
