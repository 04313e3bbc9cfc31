"""The offline engine: ``LLM(...).generate(prompts, SamplingParams(...))``, as in vLLM.

Runs the scheduler and one model runner in this process (``pagoda.engine``), and
does the frontend's share of the work itself: tokenization, chat templates,
incremental detokenization and stop strings (a stop string aborts the request at
the scheduler, which frees its blocks), grouping the ``n`` samples of a prompt.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

from tqdm import tqdm

from pagoda.engine import EngineCore
from pagoda.model_fetch import resolve_model
from pagoda.outputs import CompletionOutput, RequestOutput
from shared.protocol import RequestOutput as StepOutput
from services.tokenizer.detokenizer import IncrementalDetokenizer
from shared.config import EngineSettings, engine_settings, resolve_setting
from shared.protocol import TokenLogprobs
from shared.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]

Prompt = Union[str, list[int]]
Message = dict[str, Any]


@dataclass
class _Sample:
    """One of a prompt's n samples while it runs."""

    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class LLM:
    """``LLM(model, **settings)``: ``settings`` are exactly the engine settings of every
    pagoda process (``shared.config.EngineSettings``: ``block_size``, ``max_num_seqs``,
    ``kv_cache_bytes``, ``dtype``, ...), validated by that frozen dataclass; an unknown
    name is a TypeError naming it, a bad value a ConfigError. Unlike a process, ``LLM``
    does not read the engine settings' ``PAGODA_*`` variables (the kwargs define the
    engine); it does read three rows of the same registry: ``PAGODA_CACHE`` (where models
    are fetched), ``PAGODA_ATTENTION_BACKEND`` (when ``attention_backend`` is ``auto``) and
    ``PAGODA_TESTING=1`` (a broken scheduler invariant raises, as in the test suite)."""

    def __init__(self, model: str = EngineSettings.model, **settings: Any) -> None:
        self.settings = engine_settings({"model": model, **settings}, caller="LLM")
        self.model_dir = resolve_model(self.settings.model)
        self.engine = EngineCore(self.model_dir, self.settings,
                                 strict_invariants=bool(resolve_setting("testing")))
        self.tokenizer = _load_tokenizer(self.model_dir)
        self._ids = itertools.count()

    # -- public API --------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = _normalise_prompts(prompts)
        params = _broadcast_params(sampling_params, len(prompt_list))
        requests: list[_Request] = []
        try:
            for prompt, p in zip(prompt_list, params):
                requests.append(self._add(prompt, p))
        except BaseException:  # one bad prompt rejects the call: nothing stays queued
            self.engine.abort_request([r.request_id for r in requests])
            raise
        self._run(requests, use_tqdm)
        return [self._to_output(r) for r in requests]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        if not messages:
            raise ValueError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [
            self._require_tokenizer().apply_chat_template(
                list(conv), tokenize=False, add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_tokenizer(self):  # type: ignore[no-untyped-def]
        return self._require_tokenizer()

    def stats(self):  # type: ignore[no-untyped-def]
        return self.engine.stats()

    # -- internals ---------------------------------------------------------------------
    def _require_tokenizer(self):  # type: ignore[no-untyped-def]
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer; pass token ids as prompts")
        return self.tokenizer

    def _add(self, prompt: Prompt, params: SamplingParams) -> _Request:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            token_ids = self._require_tokenizer()(prompt)["input_ids"]
        else:
            token_ids = list(prompt)
        request = _Request(
            request_id=str(next(self._ids)),
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=token_ids,
            samples=[
                _Sample(i, params, self._detokenizer(params)) for i in range(params.n)
            ],
        )
        self.engine.add_request(request.request_id, token_ids, params)
        return request

    def _detokenizer(self, params: SamplingParams) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        return IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)

    def _run(self, requests: list[_Request], use_tqdm: bool) -> None:
        by_id = {req.request_id: req for req in requests}
        bar = tqdm(total=len(requests), desc="requests", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    req = by_id[out.request_id]
                    self._absorb(out, req.samples[out.index])
                    if out.finished and req.finished:
                        bar.update(1)
        except BaseException:
            self.engine.abort_request([r.request_id for r in requests])
            raise
        finally:
            bar.close()

    def _absorb(self, out: StepOutput, sample: _Sample) -> None:
        if sample.finish_reason is not None:
            return  # already ended by a stop string; the scheduler is catching up
        sample.token_ids.extend(out.new_token_ids)
        sample.logprobs.extend(out.new_logprobs)
        if sample.detok is not None:
            delta = sample.detok.push(out.new_token_ids)
            if delta.stop_string is not None:
                sample.finish_reason, sample.stop_reason = "stop", delta.stop_string
                self._abort_sample(out.request_id, out.index)
                return
        if out.finished:
            sample.finish_reason, sample.stop_reason = out.finish_reason, out.stop_reason
            if sample.detok is not None:
                sample.detok.finish()

    def _abort_sample(self, request_id: str, index: int) -> None:
        self.engine.abort_request([request_id], index)

    def _to_output(self, request: _Request) -> RequestOutput:
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=s.index,
                    text=s.detok.text if s.detok is not None else "",
                    token_ids=s.token_ids,
                    finish_reason=s.finish_reason,
                    logprobs=s.logprobs if s.params.logprobs is not None else None,
                    stop_reason=s.stop_reason,
                )
                for s in request.samples
            ],
        )


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


def _load_tokenizer(model_dir):  # type: ignore[no-untyped-def]
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _normalise_prompts(prompts: Any) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts must not be empty")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        return [prompts]  # one prompt given as token ids
    out: list[Prompt] = []
    for p in prompts:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
            if not p:
                raise ValueError("a token-id prompt must not be empty")
            out.append(list(p))
        else:
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")
    return out


def _broadcast_params(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} sampling params for {count} prompts")
    return params
