"""The offline engine: ``LLM(...).generate(prompts, SamplingParams(...))``, as in vLLM.

Runs the scheduler and one model runner in this process (``pagoda.engine``). The
frontend's share of the work is the frontend's own code: the tokenizer loader of
``services/tokenizer/input_processor.py`` and the ``OutputProcessor`` of
``services/tokenizer/output_processor.py`` (incremental detokenization, stop strings,
the ``n`` samples of a prompt), fed by the engine's step loop instead of a socket. A
stop string ends a sample there, and this loop aborts it at the scheduler, which
frees its blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Self

from tqdm import tqdm

from pagoda.engine import EngineCore
from pagoda.model_fetch import resolve_model
from pagoda.outputs import CompletionOutput, RequestOutput
from services.tokenizer.input_processor import load_tokenizer
from services.tokenizer.output_processor import (
    OutputItem,
    OutputProcessor,
    RequestState,
    SampleOutput,
)
from shared.config import EngineSettings, engine_settings, resolve_setting
from shared.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]

Prompt = str | list[int]
Message = dict[str, Any]


class _Finals:
    """The sink of one ``generate`` call: each sample's final (whole) output."""

    def __init__(self, num_samples: list[int]) -> None:
        self.outputs: list[list[SampleOutput]] = [[] for _ in num_samples]
        self._open = list(num_samples)
        self.num_finished_prompts = 0

    def put(self, item: OutputItem) -> None:
        if not isinstance(item, SampleOutput):
            raise item  # the offline engine rejects synchronously; never reached
        self.outputs[item.prompt_index].append(item)
        self._open[item.prompt_index] -= 1
        if self._open[item.prompt_index] == 0:
            self.num_finished_prompts += 1


class LLM:
    """``LLM(model, **settings)``: ``settings`` are exactly the engine settings of every
    pagoda process (``shared.config.EngineSettings``: ``block_size``, ``max_num_seqs``,
    ``kv_cache_bytes``, ``dtype``, ...), validated by that frozen dataclass; an unknown
    name is a TypeError naming it, a bad value a ConfigError. Unlike a process, ``LLM``
    does not read the engine settings' ``PAGODA_*`` variables (the kwargs define the
    engine); it does read three rows of the same registry: ``PAGODA_CACHE`` (where models
    are fetched), ``PAGODA_ATTENTION_BACKEND`` (when ``attention_backend`` is ``auto``) and
    ``PAGODA_TESTING=1`` (a broken scheduler invariant raises, as in the test suite).

    ``tensor_parallel_size=M`` splits the model over M ranks: this process is rank 0 and
    M-1 child processes are spawned (so a script that makes one needs the
    ``if __name__ == "__main__":`` guard, as with vLLM); ``close()`` (or ``with``) stops
    them, as does the end of the process."""

    def __init__(self, model: str = EngineSettings.model, **settings: Any) -> None:
        self.settings = engine_settings({"model": model, **settings}, caller="LLM")
        self.model_dir = resolve_model(self.settings.model)
        self.engine = EngineCore(self.model_dir, self.settings,
                                 strict_invariants=bool(resolve_setting("testing")))
        self.tokenizer = load_tokenizer(self.model_dir)
        self._outputs = OutputProcessor()
        self._num_requests = 0

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing with one rank); idempotent."""
        self.engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- public API --------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = _normalise_prompts(prompts)
        params = _broadcast_params(sampling_params, len(prompt_list))
        token_ids = [self._tokenize(p) for p in prompt_list]  # all valid before any runs
        return self._generate(prompt_list, token_ids, params, use_tqdm)

    def _generate(self, prompt_list: list[Prompt], token_ids: list[list[int]],
                  params: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        token_ids = [_truncated(ids, p, self.engine.max_model_len)
                     for ids, p in zip(token_ids, params)]
        finals = _Finals([p.n for p in params])
        request_ids: list[str] = []
        try:
            for i, (ids, p) in enumerate(zip(token_ids, params)):
                rid = str(self._num_requests)
                self._num_requests += 1
                self._outputs.add(RequestState(rid, i, p, len(ids), self.tokenizer, False, finals,
                                               ids))
                request_ids.append(rid)
                self.engine.add_request(rid, ids, p)
            self._run(finals, len(prompt_list), use_tqdm)
        except BaseException:  # one bad prompt (or a Ctrl-C) ends the call: nothing stays queued
            self.engine.abort_request(request_ids)
            for rid in request_ids:
                self._outputs.end(rid, deliver=False)
            raise
        return [
            RequestOutput(
                request_id=rid, prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=ids,
                outputs=[_completion(s, p) for s in sorted(outs, key=lambda o: o.index)],
                num_cached_tokens=max((s.num_cached_tokens for s in outs), default=0),
                prompt_logprobs=next((s.prompt_logprobs for s in outs
                                      if s.prompt_logprobs is not None), None),
            )
            for rid, prompt, ids, p, outs in zip(request_ids, prompt_list, token_ids, params,
                                                 finals.outputs)
        ]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """As vLLM's ``LLM.chat``: ``tools`` (OpenAI function tools) are rendered by the
        chat template; the output text is returned as the model wrote it (parse tool calls
        from it, or constrain it with ``SamplingParams.structured_outputs``)."""
        if not messages:
            raise ValueError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        extra = dict(chat_template_kwargs or {})
        if tools is not None:
            extra["tools"] = list(tools)
        tokenizer = self._require_tokenizer()
        prompts: list[Prompt] = [
            tokenizer.apply_chat_template(
                list(conv), tokenize=False, add_generation_prompt=add_generation_prompt, **extra,
            )
            for conv in conversations
        ]
        # the template writes BOS: no special tokens added again (as the frontend does)
        token_ids = [list(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        params = _broadcast_params(sampling_params, len(prompts))
        return self._generate(prompts, token_ids, params, use_tqdm)

    def get_tokenizer(self):  # type: ignore[no-untyped-def]
        return self._require_tokenizer()

    def stats(self):  # type: ignore[no-untyped-def]
        return self.engine.stats()

    # -- internals ---------------------------------------------------------------------
    def _require_tokenizer(self):  # type: ignore[no-untyped-def]
        if self.tokenizer is None:
            raise ValueError(f"{self.model_dir} has no tokenizer; pass token ids as prompts")
        return self.tokenizer

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return list(self._require_tokenizer()(prompt)["input_ids"])
        return list(prompt)

    def _run(self, finals: _Finals, num_prompts: int, use_tqdm: bool) -> None:
        bar = tqdm(total=num_prompts, desc="requests", disable=not use_tqdm)
        try:
            while self.engine.has_unfinished_requests():
                stopped = self._outputs.process(self.engine.step())
                for request_id, index in stopped:  # the scheduler would keep decoding them
                    self._outputs.process(self.engine.abort_request([request_id], index))
                bar.update(finals.num_finished_prompts - bar.n)
        finally:
            bar.close()


def _truncated(token_ids: list[int], params: SamplingParams, max_model_len: int) -> list[int]:
    """``truncate_prompt_tokens``: the prompt's last k tokens (-1: max_model_len - 1)."""
    k = params.truncate_prompt_tokens
    if k is None:
        return token_ids
    return token_ids[-(max_model_len - 1 if k == -1 else k):]


def _completion(sample: SampleOutput, params: SamplingParams) -> CompletionOutput:
    return CompletionOutput(
        index=sample.index, text=sample.text, token_ids=sample.token_ids,
        finish_reason=sample.finish_reason,
        logprobs=sample.logprobs if params.logprobs is not None else None,
        stop_reason=sample.stop_reason,
    )


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
