"""OpenAI response objects of the HTTP API, built from the frontend's ``SampleOutput``s.

One ``ResponseBuilder`` per HTTP request shapes its outputs as a whole response
(``text_completion`` / ``chat.completion``) or as SSE chunks (the same objects, chat as
``chat.completion.chunk`` deltas). With several prompts and ``n`` samples each, choice
``index`` is ``prompt_index * n + sample_index``, as OpenAI numbers them. Usage counts
every prompt once and every sample's output tokens. Logprobs use OpenAI's two shapes:
completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` and
chat's ``content`` list; a token's text is its decoded string (``token_id:<id>`` with
vLLM's ``return_tokens_as_token_ids``). With ``echo`` and ``logprobs`` a completion's
logprobs cover the prompt tokens first (the first one ``null``), then the output.
With ``echo`` and ``max_tokens: 0`` (``generates`` false) the one token the engine
sampled is left out: the choice is the prompt, ``finish_reason: "length"``, no completion
tokens in the usage (vLLM does the same). ``best_of`` (completions, not streamed): of the ``best_of`` samples of each prompt, the
``n`` with the highest cumulative logprob become its choices, most likely first, as
vLLM 0.x did; usage counts every generated token, as OpenAI bills them. A chat request
with tools gets its text through ``tool_calls.ToolCallOutput``: ``message.tool_calls``,
or ``delta.tool_calls`` while streaming, and ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from services.tokenizer.http_errors import ApiError
from services.tokenizer.input_processor import ProcessedPrompt
from services.tokenizer.output_processor import SampleOutput
from services.tokenizer.sse import DONE, sse
from services.tokenizer.tool_calls import ToolCallOutput
from shared.protocol import TokenLogprobs

Kind = Literal["completion", "chat"]


class ResponseBuilder:
    """Response bodies and stream chunks of one completions or chat request."""

    def __init__(self, kind: Kind, response_id: str, model: str, tokenizer: Any | None,
                 n: int, *, echo: Sequence[str] | None = None, logprobs: bool = False,
                 include_usage: bool = False, best_of: int | None = None,
                 tokens_as_ids: bool = False, tool_calls: ToolCallOutput | None = None,
                 generates: bool = True, return_token_ids: bool = False,
                 continuous_usage: bool = False) -> None:
        self.kind, self.response_id, self.model = kind, response_id, model
        self.created = int(time.time())
        self.include_usage = include_usage
        self._tokenizer = tokenizer
        self._n = n
        self._echo = list(echo) if echo is not None else None  # per prompt
        self._logprobs = logprobs
        self._best_of = best_of if best_of is not None and best_of > n else None
        self._tokens_as_ids = tokens_as_ids
        self._tool_calls = tool_calls  # chat with tools: the text parsed into tool calls
        self._generates = generates
        self._return_token_ids = return_token_ids
        self._continuous_usage = continuous_usage
        self._prompt_token_ids: list[list[int]] = []  # per prompt, once validated
        self._prompt_tokens: dict[int, int] = {}  # prompt index -> tokens
        self._output_tokens: dict[tuple[int, int], int] = {}  # (prompt, sample) -> tokens
        self._text_offset: dict[int, int] = {}  # choice index -> chars sent (completions)
        self._started: set[int] = set()  # choices whose first chunk went out

    def set_prompts(self, prompts: Sequence[ProcessedPrompt]) -> None:
        """The validated prompts (``return_token_ids`` reports their token ids)."""
        self._prompt_token_ids = [p.prompt_token_ids for p in prompts]

    def _token_ids(self, body: dict[str, Any], out: SampleOutput, prompt: bool) -> dict[str, Any]:
        """vLLM's ``return_token_ids``: the output's ids, and the prompt's if ``prompt``."""
        if self._return_token_ids:
            if prompt:
                body["prompt_token_ids"] = self._prompt_token_ids[out.prompt_index]
            body["token_ids"] = list(out.token_ids)
        return body

    def _visible(self, out: SampleOutput) -> SampleOutput:
        """What the client sees of an output (nothing generated, unless it generates)."""
        if self._generates:
            return out
        return dataclasses.replace(
            out, text="", token_ids=[], logprobs=[], num_output_tokens=0, stop_reason=None,
            finish_reason=None if out.finish_reason is None else "length")

    # -- usage ------------------------------------------------------------------------------
    def _note(self, out: SampleOutput) -> int:
        self._prompt_tokens[out.prompt_index] = out.num_prompt_tokens
        self._output_tokens[(out.prompt_index, out.index)] = out.num_output_tokens
        return out.prompt_index * self._n + out.index

    def usage(self) -> dict[str, Any]:
        prompt = sum(self._prompt_tokens.values())
        completion = sum(self._output_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    # -- whole responses ------------------------------------------------------------------------
    def whole(self, outputs: Sequence[SampleOutput]) -> dict[str, Any]:
        """The non-streaming body, from each sample's single (final) output."""
        choices = []
        outputs = [self._visible(out) for out in outputs]
        for out in outputs:
            self._note(out)  # usage: every sample generated, best_of's dropped ones too
        if self._best_of is not None:
            outputs = self._keep_best(outputs)
        for out in outputs:
            prompt_index = out.prompt_index
            choice = prompt_index * self._n + out.index
            text = out.text
            if self.kind == "completion":
                if self._echo is not None:
                    text = self._echo[prompt_index] + text
                choices.append(self._token_ids({
                    "index": choice, "text": text,
                    "logprobs": self._completion_logprobs(choice, out),
                    "finish_reason": out.finish_reason, "stop_reason": out.stop_reason},
                    out, prompt=True))
            else:
                message, finish_reason = {"role": "assistant", "content": text}, out.finish_reason
                if self._tool_calls is not None:
                    message, finish_reason = self._tool_calls.message(text, finish_reason)
                if self._echo and self._echo[0]:  # chat echo: the message it continues
                    message["content"] = self._echo[0] + (message["content"] or "")
                choices.append(self._token_ids({
                    "index": choice, "message": message, "logprobs": self._chat_logprobs(out),
                    "finish_reason": finish_reason, "stop_reason": out.stop_reason},
                    out, prompt=False))
        choices.sort(key=lambda c: c["index"])
        body = {"id": self.response_id, "object": self._object(chunk=False),
                "created": self.created, "model": self.model, "choices": choices,
                "usage": self.usage()}
        if self._return_token_ids and self.kind == "chat" and self._prompt_token_ids:
            body["prompt_token_ids"] = self._prompt_token_ids[0]
        return body

    def _keep_best(self, outputs: Sequence[SampleOutput]) -> list[SampleOutput]:
        """Per prompt, the n samples with the highest cumulative logprob, renumbered in
        that order (ties: the lower sample index first)."""
        by_prompt: dict[int, list[SampleOutput]] = {}
        for out in outputs:
            by_prompt.setdefault(out.prompt_index, []).append(out)
        kept: list[SampleOutput] = []
        for samples in by_prompt.values():
            samples.sort(key=lambda o: (-_cumulative_logprob(o), o.index))
            kept.extend(dataclasses.replace(o, index=rank)
                        for rank, o in enumerate(samples[: self._n]))
        return kept

    # -- stream chunks ------------------------------------------------------------------------
    def chunks(self, out: SampleOutput) -> list[dict[str, Any]]:
        """The SSE chunks for one streamed output (none for an empty delta)."""
        out = self._visible(out)
        prompt_index = out.prompt_index
        choice = self._note(out)
        first = choice not in self._started
        self._started.add(choice)
        if self.kind == "completion":
            text = out.text
            if first and self._echo is not None:
                text = self._echo[prompt_index] + text
            if not text and out.finish_reason is None and not (
                    (self._logprobs or self._return_token_ids) and out.token_ids):
                return []
            body = {"index": choice, "text": text,
                    "logprobs": self._completion_logprobs(choice, out, len(text) - len(out.text)),
                    "finish_reason": out.finish_reason, "stop_reason": out.stop_reason}
            return [self._chunk(self._token_ids(body, out, prompt=first))]
        chunks = []
        if first:  # OpenAI's first chat chunk of a choice carries only the role
            echo = self._echo[0] if self._echo else ""
            chunk = self._chunk({"index": choice, "delta": {"role": "assistant", "content": echo},
                                 "logprobs": None, "finish_reason": None})
            if self._return_token_ids and self._prompt_token_ids:
                chunk["prompt_token_ids"] = self._prompt_token_ids[prompt_index]
            chunks.append(chunk)
        delta: dict[str, Any] = {"content": out.text} if out.text else {}
        finish_reason = out.finish_reason
        if self._tool_calls is not None:  # content held back, tool_calls deltas
            delta, finish_reason = self._tool_calls.delta(choice, out.text, finish_reason)
        if delta or finish_reason is not None or (
                (self._logprobs or self._return_token_ids) and out.token_ids):
            chunks.append(self._chunk(self._token_ids({
                "index": choice, "delta": delta, "logprobs": self._chat_logprobs(out),
                "finish_reason": finish_reason, "stop_reason": out.stop_reason},
                out, prompt=False)))
        return chunks

    def events(self, out: SampleOutput) -> list[str]:
        return [sse(chunk) for chunk in self.chunks(out)]

    def closing_events(self) -> list[str]:
        return [*([sse(self.usage_chunk())] if self.include_usage else []), DONE]

    def error_events(self, error: ApiError) -> list[str]:
        return [sse(error.body()), DONE]

    def usage_chunk(self) -> dict[str, Any]:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        return {"id": self.response_id, "object": self._object(chunk=True),
                "created": self.created, "model": self.model, "choices": [],
                "usage": self.usage()}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        chunk = {"id": self.response_id, "object": self._object(chunk=True),
                 "created": self.created, "model": self.model, "choices": [choice]}
        if self._continuous_usage:  # vLLM: the usage so far on every chunk
            chunk["usage"] = self.usage()
        elif self.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk

    def _object(self, chunk: bool) -> str:
        if self.kind == "completion":
            return "text_completion"
        return "chat.completion.chunk" if chunk else "chat.completion"

    # -- logprobs ------------------------------------------------------------------------------
    def _token_text(self, token_id: int) -> str:
        if self._tokenizer is None or self._tokens_as_ids:
            return f"token_id:{token_id}"
        return str(self._tokenizer.decode([token_id]))

    def _completion_logprobs(self, choice: int, out: SampleOutput,
                             echo_chars: int = 0) -> dict[str, Any] | None:
        if not self._logprobs:
            return None
        offset = self._text_offset.get(choice, 0) + echo_chars
        pairs: Iterable[tuple[int, TokenLogprobs | None]] = zip(out.token_ids, out.logprobs)
        if out.prompt_logprobs is not None and out.prompt_token_ids is not None:
            # echo: the prompt's tokens come first, from offset 0
            offset = self._text_offset.get(choice, 0)
            pairs = itertools.chain(zip(out.prompt_token_ids, out.prompt_logprobs), pairs)
        tokens, token_lps, tops, offsets = [], [], [], []
        for token_id, lp in pairs:
            text = self._token_text(token_id)
            tokens.append(text)
            offsets.append(offset)
            offset += len(text)
            token_lps.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else self._top_dict(token_id, lp))
        self._text_offset[choice] = offset
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
                "text_offset": offsets}

    def _top_dict(self, token_id: int, lp: TokenLogprobs) -> dict[str, float]:
        top = {self._token_text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs)}
        top.setdefault(self._token_text(token_id), lp.logprob)
        return top

    def _chat_logprobs(self, out: SampleOutput) -> dict[str, Any] | None:
        if not self._logprobs:
            return None
        content = []
        for token_id, lp in zip(out.token_ids, out.logprobs):
            text = self._token_text(token_id)
            entry: dict[str, Any] = {"token": text, "bytes": list(text.encode()),
                                     "logprob": None if lp is None else lp.logprob,
                                     "top_logprobs": []}
            if lp is not None:
                entry["top_logprobs"] = [
                    {"token": (t := self._token_text(tid)), "bytes": list(t.encode()),
                     "logprob": v} for tid, v in zip(lp.top_token_ids, lp.top_logprobs)]
            content.append(entry)
        return {"content": content}


def _cumulative_logprob(out: SampleOutput) -> float:
    return sum(lp.logprob for lp in out.logprobs if lp is not None)
