"""The frontend's side of prompt logprobs, logit_bias, best_of and token-id rendering,
without a model: request bodies -> SamplingParams, engine outputs -> SampleOutputs ->
OpenAI response bodies."""

from __future__ import annotations

from typing import Any

import pytest

from services.tokenizer.http_errors import ApiError
from services.tokenizer.http_protocol import ChatCompletionRequest, CompletionRequest
from services.tokenizer.http_responses import ResponseBuilder
from services.tokenizer.output_processor import RequestState, SampleOutput
from shared.protocol import EngineOutput, TokenLogprobs
from shared.sampling_params import SamplingParams

PROMPT = [11, 12, 13]
PROMPT_LPS = [None, TokenLogprobs(-1.5, 2, [40], [-0.5]), TokenLogprobs(-0.25, 1, [13], [-0.25])]


def lp(value: float, token: int) -> TokenLogprobs:
    return TokenLogprobs(value, 1, [token], [value])


def bad(body: Any, param: str) -> None:
    with pytest.raises(ApiError) as e:
        body.sampling_params()
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_completion_bodies_to_sampling_params() -> None:
    echo = CompletionRequest(prompt="x", echo=True, logprobs=2).sampling_params()
    assert echo.prompt_logprobs == 2 and echo.logprobs == 2
    assert CompletionRequest(prompt="x", logprobs=2).sampling_params().prompt_logprobs is None
    assert CompletionRequest(prompt="x", echo=True).sampling_params().prompt_logprobs is None
    biased = CompletionRequest(prompt="x", logit_bias={"5": 1.5, "7": -100}).sampling_params()
    assert biased.logit_bias == {5: 1.5, 7: -100.0}
    bad(CompletionRequest(prompt="x", logit_bias={"five": 1.0}), "logit_bias")
    bad(CompletionRequest(prompt="x", logit_bias={"5": 100.5}), "logit_bias")
    bad(CompletionRequest(prompt="x", logit_bias={str(i): 1.0 for i in range(301)}), "logit_bias")
    best = CompletionRequest(prompt="x", n=2, best_of=5, temperature=0.8)
    assert best.num_choices == 2
    assert (best.sampling_params().n, best.sampling_params().logprobs) == (5, 0)
    assert CompletionRequest(prompt="x", best_of=1).sampling_params().n == 1
    bad(CompletionRequest(prompt="x", n=3, best_of=2), "best_of")
    bad(CompletionRequest(prompt="x", best_of=2, stream=True), "best_of")
    bad(CompletionRequest(prompt="x", best_of=2, temperature=0.0), "best_of")
    bad(CompletionRequest(prompt="x", best_of=129), "best_of")


def test_chat_top_logprobs_limit_and_logit_bias() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    ok = ChatCompletionRequest(messages=msgs, logprobs=True, top_logprobs=20,
                               logit_bias={"3": -1}).sampling_params()
    assert ok.logprobs == 20 and ok.logit_bias == {3: -1.0}
    bad(ChatCompletionRequest(messages=msgs, logprobs=True, top_logprobs=21), "top_logprobs")


def test_every_sample_gets_the_prompt_logprobs_in_its_first_output() -> None:
    for stream in (True, False):
        sink: list[SampleOutput] = []
        params = SamplingParams(n=2, prompt_logprobs=1, logprobs=0, max_tokens=2)
        state = RequestState("r", 0, params, len(PROMPT), None, stream, sink, PROMPT)  # type: ignore[arg-type]
        outs = [
            EngineOutput("r", 0, [5], [lp(-0.1, 5)], prompt_logprobs=PROMPT_LPS),
            EngineOutput("r", 1, [6], [lp(-0.2, 6)]),
            EngineOutput("r", 0, [7], [lp(-0.3, 7)], finish_reason="length"),
            EngineOutput("r", 1, [8], [lp(-0.4, 8)], finish_reason="length"),
        ]
        got = [item for out in outs if (item := state.absorb(out)[0]) is not None]
        first = {o.index: o for o in reversed(got)}
        for o in got:
            if o is first[o.index]:
                assert o.prompt_token_ids == PROMPT and o.prompt_logprobs == PROMPT_LPS
            else:
                assert o.prompt_logprobs is None and o.prompt_token_ids is None
    plain = RequestState("p", 0, SamplingParams(), 3, None, False, [], PROMPT)  # type: ignore[arg-type]
    assert plain.prompt_token_ids is None  # nothing kept for requests that do not ask


def sample(index: int, tokens: list[int], lps: list[float], **kw: Any) -> SampleOutput:
    return SampleOutput(0, index, "", tokens, [lp(v, t) for v, t in zip(lps, tokens)],
                        "length", None, len(PROMPT), len(tokens), 0, **kw)


def test_echo_logprobs_cover_the_prompt_then_the_output() -> None:
    builder = ResponseBuilder("completion", "cmpl-1", "m", None, 1, echo=["abc"], logprobs=True)
    body = builder.whole([sample(0, [5], [-0.1], prompt_token_ids=PROMPT,
                                 prompt_logprobs=PROMPT_LPS)])
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["token_id:11", "token_id:12", "token_id:13", "token_id:5"]
    assert logprobs["token_logprobs"] == [None, -1.5, -0.25, -0.1]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {"token_id:40": -0.5, "token_id:12": -1.5}
    assert logprobs["text_offset"] == [0, 11, 22, 33]


def test_best_of_keeps_the_most_likely_samples_and_bills_all() -> None:
    builder = ResponseBuilder("completion", "cmpl-2", "m", None, 2, best_of=3)
    samples = [sample(0, [1, 2], [-1.0, -2.0]), sample(1, [3, 4], [-0.5, -0.5]),
               sample(2, [5, 6], [-0.1, -9.0])]
    body = builder.whole(samples)
    assert [(c["index"], c["logprobs"]) for c in body["choices"]] == [(0, None), (1, None)]
    assert body["usage"]["completion_tokens"] == 6
    kept = builder._keep_best(samples)
    assert [(o.index, o.token_ids) for o in kept] == [(0, [3, 4]), (1, [1, 2])]


class _Tokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_return_tokens_as_token_ids() -> None:
    out = sample(0, [5], [-0.1])
    chat = ResponseBuilder("chat", "c", "m", _Tokenizer(), 1, logprobs=True, tokens_as_ids=True)
    entry = chat.whole([out])["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "token_id:5" and entry["top_logprobs"][0]["token"] == "token_id:5"
    plain = ResponseBuilder("chat", "c", "m", _Tokenizer(), 1, logprobs=True)
    assert plain.whole([out])["choices"][0]["logprobs"]["content"][0]["token"] == "f"
