"""Prompt logprobs, logit_bias, top_logprobs, token-id rendering and best_of through a live
`pagoda serve`, and a loglikelihood evaluation by lm-evaluation-harness against it.

The stack runs SmolLM2 in float32 with a 32-token step budget, so every prompt over 32
tokens is prefilled in chunks. Oracle: HF transformers' float32 forward (log-softmax at
every position, 1e-4 per token). Clients: the official ``openai`` package, the native
``pagoda.client``, and ``lm_eval`` (``local-completions``: echo + logprobs + max_tokens 1,
the prompts as token ids, 8 per request) on the small multiple-choice task in
``lm_eval_task/``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from pagoda.client import Client
from support.checkpoints import load_hf
from support.live_stack import LiveStack, assert_idle_and_clean, openai_client, serving

pytestmark = pytest.mark.slow

TASK_DIR = Path(__file__).parent / "lm_eval_task"
TOL = 1e-4
TEXT = ("The lighthouse keeper climbed the narrow stairs every evening, carrying a lamp, a "
        "book of tide tables and a flask of tea. From the top he could see the fishing boats "
        "returning to the harbour")


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    log_path = tmp_path_factory.mktemp("logprobs-serve") / "serve.log"
    with serving(smollm2_dir, log_path, 1, "--num-kv-blocks", "256", "--max-model-len",
                       "1024", "--max-num-batched-tokens", "32") as live:
        yield live


@pytest.fixture(scope="module")
def hf(smollm2_dir: Path) -> Any:
    return load_hf(smollm2_dir)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def client(stack: LiveStack) -> openai.OpenAI:
    return openai_client(stack)


def hf_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:  # [P, V]: row p scores token p + 1
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def assert_prompt_logprobs(values: list[float | None], ref: torch.Tensor, ids: list[int]) -> None:
    assert len(values) >= len(ids) and values[0] is None
    want = [float(ref[p - 1, ids[p]]) for p in range(1, len(ids))]
    diff = max((abs(a - b) for a, b in zip(values[1 : len(ids)], want)), default=0.0)  # type: ignore[operator]
    assert diff <= TOL, f"max abs diff {diff:.3g} over {len(ids)} prompt tokens"


def test_echo_logprobs_match_hf_chunked_cached_and_streamed(stack: LiveStack, hf: Any,
                                                             tokenizer: Any) -> None:
    after = len(stack.log())
    api = client(stack)
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) > 32, "the prompt must take more than one step"
    ref = hf_logprobs(hf, ids)
    api.completions.create(model="smollm2", prompt=TEXT, max_tokens=1)  # now in the prefix cache
    got = api.completions.create(model="smollm2", prompt=TEXT, echo=True, logprobs=2,
                                 max_tokens=1, temperature=0.0)
    choice = got.choices[0]
    assert choice.text.startswith(TEXT) and choice.logprobs is not None
    lps = choice.logprobs
    assert len(lps.tokens or []) == len(ids) + 1 and lps.top_logprobs is not None
    assert_prompt_logprobs(lps.token_logprobs or [], ref, ids)
    assert lps.top_logprobs[0] is None and all(len(t) <= 3 for t in lps.top_logprobs[1:])
    assert abs((lps.token_logprobs or [])[-1] - float(ref[-1].max())) <= TOL  # greedy output
    assert lps.text_offset is not None and lps.text_offset[0] == 0

    async def streamed() -> list[Any]:
        aclient = openai.AsyncOpenAI(base_url=stack.http, api_key="unused", max_retries=0)
        stream = await aclient.completions.create(model="smollm2", prompt=ids, echo=True,
                                                  logprobs=0, max_tokens=3, temperature=0.0,
                                                  stream=True)
        return [chunk async for chunk in stream]

    chunks = asyncio.run(streamed())
    first = chunks[0].choices[0].logprobs
    assert first is not None and first.tokens == lps.tokens
    assert first.token_logprobs == pytest.approx(lps.token_logprobs, abs=TOL)
    assert_idle_and_clean(stack, after)


def test_several_prompts_each_scored(stack: LiveStack, hf: Any, tokenizer: Any) -> None:
    prompts = [tokenizer(t)["input_ids"] for t in (TEXT[:80], TEXT, "Hello")]
    got = client(stack).completions.create(model="smollm2", prompt=prompts, echo=True,
                                           logprobs=1, max_tokens=1, temperature=0.0)
    assert [c.index for c in got.choices] == [0, 1, 2]
    for choice, ids in zip(got.choices, prompts):
        assert choice.logprobs is not None
        assert_prompt_logprobs(choice.logprobs.token_logprobs or [], hf_logprobs(hf, ids), ids)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(stack: LiveStack, hf: Any,
                                                        tokenizer: Any) -> None:
    """vLLM's prompt-only scoring: the answer is the prompt, its logprobs, no completion."""
    ids = tokenizer(TEXT)["input_ids"]
    api = client(stack)
    for stream in (False, True):
        got = api.completions.create(model="smollm2", prompt=TEXT, echo=True, logprobs=1,
                                     max_tokens=0, stream=stream)
        choices = [c for chunk in got for c in chunk.choices] if stream else got.choices
        assert "".join(c.text for c in choices) == TEXT
        assert [c.finish_reason for c in choices][-1] == "length"
        tokens = [t for c in choices if c.logprobs for t in c.logprobs.tokens or []]
        values = [v for c in choices if c.logprobs for v in c.logprobs.token_logprobs or []]
        assert len(tokens) == len(values) == len(ids)
        assert_prompt_logprobs(values, hf_logprobs(hf, ids), ids)
        if not stream:
            assert got.usage is not None and got.usage.completion_tokens == 0
            assert got.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError, match="echo"):
        api.completions.create(model="smollm2", prompt=TEXT, max_tokens=0)


def test_native_client_prompt_logprobs(stack: LiveStack, hf: Any, tokenizer: Any) -> None:
    ids = tokenizer(TEXT)["input_ids"]
    with Client(stack.frontends[0]) as native:
        result = native.generate(TEXT, prompt_logprobs=2, max_tokens=2, temperature=0.0)
    assert result.prompt_token_ids == ids and result.prompt_logprobs is not None
    values = [None if lp is None else lp.logprob for lp in result.prompt_logprobs]
    assert_prompt_logprobs(values, hf_logprobs(hf, ids), ids)
    assert all(len(lp.top_token_ids) == 2 for lp in result.prompt_logprobs[1:] if lp)


def first_token(api: openai.OpenAI, **kw: Any) -> int:
    got = api.completions.create(model="smollm2", prompt=TEXT, max_tokens=1, temperature=0.0,
                                 logprobs=0, extra_body={"return_tokens_as_token_ids": True},
                                 **kw)
    tokens = got.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert tokens is not None and tokens[0].startswith("token_id:")
    return int(tokens[0].removeprefix("token_id:"))


def test_logit_bias_and_its_bounds(stack: LiveStack) -> None:
    api = client(stack)
    greedy = first_token(api)
    forced = (greedy + 1000) % 49152
    assert first_token(api, logit_bias={str(forced): 100}) == forced
    assert first_token(api, logit_bias={str(greedy): -100}) != greedy
    chat = api.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Say yes."}], max_tokens=1,
        temperature=0.0, logprobs=True, logit_bias={str(forced): 100},
        extra_body={"return_tokens_as_token_ids": True})
    assert chat.choices[0].logprobs.content[0].token == f"token_id:{forced}"  # type: ignore[union-attr,index]
    for bias, words in (({"49152": 1}, "vocabulary"), ({"x": 1}, "integers"),
                        ({"5": 101}, "-100, 100")):
        with pytest.raises(openai.BadRequestError, match=words):
            api.completions.create(model="smollm2", prompt="hi", logit_bias=bias)  # type: ignore[arg-type]


def test_chat_top_logprobs_up_to_20(stack: LiveStack) -> None:
    api = client(stack)
    msgs = [{"role": "user", "content": "Name a colour."}]
    got = api.chat.completions.create(model="smollm2", messages=msgs, max_tokens=3,  # type: ignore[arg-type]
                                      temperature=0.0, logprobs=True, top_logprobs=20)
    content = got.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(entry.top_logprobs) == 20 for entry in content)
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        api.chat.completions.create(model="smollm2", messages=msgs, logprobs=True,  # type: ignore[arg-type]
                                    top_logprobs=21)


def test_best_of_returns_the_most_likely_of_more_samples(stack: LiveStack) -> None:
    api = client(stack)
    got = api.completions.create(model="smollm2", prompt=TEXT, n=2, best_of=4, seed=7,
                                 temperature=1.0, max_tokens=4, logprobs=0,
                                 extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1]
    sums = [sum(c.logprobs.token_logprobs or []) for c in got.choices]  # type: ignore[union-attr]
    assert sums[0] >= sums[1]
    assert got.usage is not None and got.usage.completion_tokens == 16  # all 4 samples ran
    for kw in ({"best_of": 1, "n": 2}, {"best_of": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError, match="best_of"):
            api.completions.create(model="smollm2", prompt="hi", **kw)  # type: ignore[call-overload]


# -- lm-evaluation-harness ----------------------------------------------------------------


def hf_loglikelihood(hf: Any, tokenizer: Any, context: str,
                     continuation: str) -> tuple[float, bool, int]:
    """(loglikelihood, greedy, continuation tokens), with lm-eval's own split
    (``TemplateLM._encode_pair``: trailing spaces of the context move to the continuation;
    the whole text encoded once), scored by HF."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    ctx_len = len(tokenizer.encode(context, add_special_tokens=False))
    lp = hf_logprobs(hf, whole)[ctx_len - 1 : -1]  # rows scoring the continuation
    cont = torch.tensor(whole[ctx_len:])
    token_lp = lp.gather(1, cont.view(-1, 1)).view(-1)
    return float(token_lp.sum()), bool((lp.argmax(dim=-1) == cont).all()), len(cont)


def test_lm_eval_local_completions_loglikelihoods_match_hf(
        stack: LiveStack, smollm2_dir: Path, hf: Any, tokenizer: Any, tmp_path: Path) -> None:
    pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e .[test]")
    after = len(stack.log())
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    model_args = (f"model=smollm2,base_url={stack.http}/completions,tokenizer={smollm2_dir},"
                  "tokenizer_backend=huggingface,num_concurrent=1,max_retries=1")
    run = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
         model_args, "--batch_size", "8", "--tasks", "pagoda_mc", "--include_path", ".",
         "--log_samples", "--output_path", str(tmp_path / "out")],
        check=False, cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    (samples_file,) = (tmp_path / "out").rglob("samples_pagoda_mc_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == 30
    checked = 0
    for sample in samples:
        for args, resp in zip(sample["arguments"].values(), sample["resps"], strict=True):
            ours, greedy = float(resp[0][0]), resp[0][1] == "True"
            want, want_greedy, n = hf_loglikelihood(hf, tokenizer, args["arg_0"], args["arg_1"])
            assert abs(ours - want) <= TOL * n, (args, ours, want)
            assert greedy == want_greedy, args
            checked += 1
    assert checked == 101
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert 0.0 <= results["results"]["pagoda_mc"]["acc,none"] <= 1.0
    assert_idle_and_clean(stack, after)
