"""The OpenAI-compatible HTTP API of a live `pagoda serve` (2 frontends, one port).

Oracle: the offline ``pagoda.LLM`` on the same model, greedy. Clients: the official
``openai`` package (sync and asyncio, streaming and not) and raw ``httpx`` for what
the openai client cannot send (bad JSON, NaN literals, oversized bodies). Faults: bad
requests beside an in-flight stream, a full queue, a client closing its stream, and
last, a worker killed under in-flight requests (it ends the module's stack).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pagoda import SamplingParams
from support.live_stack import LiveStack, assert_idle_and_clean, openai_client

pytestmark = pytest.mark.slow

PROMPTS = ["The three primary colours are", "Write a haiku about the sea:"]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour of the rainbow."}]
LONG = {"prompt": "Tell me a very long story about a dragon.", "max_tokens": 1500,
        "ignore_eos": True, "temperature": 0.0}


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def sync_client(stack: LiveStack) -> openai.OpenAI:
    return openai_client(stack)


def async_client(stack: LiveStack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.http, api_key="unused", max_retries=0, timeout=120)


def root(stack: LiveStack) -> str:
    return stack.http.removesuffix("/v1")


def wait_healthy(stack: LiveStack, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (r := httpx.get(f"{root(stack)}/health")).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)  # polling /health, as a load balancer does


def test_models_health_tokenize_docs(http_stack: LiveStack, smollm2_dir: Path, offline: Any) -> None:
    wait_healthy(http_stack)
    assert httpx.get(f"{root(http_stack)}/health").text == "ok"
    models = sync_client(http_stack).models.list().data
    assert [m.id for m in models] == [str(smollm2_dir)] and models[0].owned_by == "pagoda"
    r = httpx.post(f"{root(http_stack)}/tokenize", json={"prompt": PROMPTS[0]})
    ids = offline.get_tokenizer()(PROMPTS[0])["input_ids"]
    assert r.json() == {"count": len(ids), "max_model_len": 2048, "tokens": ids, "token_strs": None}
    r = httpx.post(f"{root(http_stack)}/detokenize", json={"tokens": ids})
    assert r.json() == {"prompt": PROMPTS[0]}
    assert "/v1/chat/completions" in httpx.get(f"{root(http_stack)}/openapi.json").json()["paths"]
    assert httpx.get(f"{root(http_stack)}/docs").status_code == 200
    assert httpx.get(f"{root(http_stack)}/metrics").status_code == 200


def test_completions_match_offline_sync(http_stack: LiveStack, smollm2_dir: Path,
                                        offline: Any) -> None:
    expected = offline.generate(PROMPTS, greedy(6), use_tqdm=False)
    client = sync_client(http_stack)
    got = client.completions.create(model=str(smollm2_dir), prompt=PROMPTS, max_tokens=6,
                                    temperature=0.0)
    assert [c.index for c in got.choices] == [0, 1]
    for choice, exp in zip(got.choices, expected):
        assert choice.text == exp.outputs[0].text
        assert choice.finish_reason == exp.outputs[0].finish_reason
    assert got.usage is not None
    assert got.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert got.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)
    # token ids in, echo on: the same tokens, the prompt text in front
    ids = expected[0].prompt_token_ids
    echoed = client.completions.create(model="smollm2", prompt=ids, max_tokens=6,
                                       temperature=0.0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + expected[0].outputs[0].text


def test_completions_stream_async_with_usage(http_stack: LiveStack, offline: Any) -> None:
    expected = offline.generate([PROMPTS[1]], greedy(8), use_tqdm=False)[0]

    async def run() -> tuple[str, list[Any]]:
        client = async_client(http_stack)
        stream = await client.completions.create(
            model="smollm2", prompt=PROMPTS[1], max_tokens=8, temperature=0.0, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        return "".join(c.choices[0].text for c in chunks if c.choices), chunks

    text, chunks = asyncio.run(run())
    assert text == expected.outputs[0].text
    assert chunks[-2].choices[0].finish_reason == expected.outputs[0].finish_reason
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        len(expected.prompt_token_ids), len(expected.outputs[0].token_ids))


def test_chat_matches_offline_chat_sync_and_async_stream(http_stack: LiveStack,
                                                         offline: Any) -> None:
    expected = offline.chat(CHAT, greedy(8), use_tqdm=False)[0]
    got = sync_client(http_stack).chat.completions.create(
        model="smollm2", messages=CHAT, max_completion_tokens=8, temperature=0.0)  # type: ignore[arg-type]
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.outputs[0].text
    assert got.usage is not None and got.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert got.usage.completion_tokens == len(expected.outputs[0].token_ids)

    async def run() -> list[Any]:
        stream = await async_client(http_stack).chat.completions.create(
            model="smollm2", messages=CHAT, max_tokens=8, temperature=0.0, stream=True)  # type: ignore[arg-type]
        return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == expected.outputs[0].finish_reason


def test_n2_with_seed_is_reproducible(http_stack: LiveStack) -> None:
    client = sync_client(http_stack)

    def sample() -> Any:
        return client.completions.create(model="smollm2", prompt=PROMPTS[0], n=2, seed=1234,
                                         temperature=1.0, max_tokens=4)

    first, second = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert first.usage is not None and first.usage.completion_tokens == 8


BIG = b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}'
# (name, path, body (JSON object or raw bytes), status, param, words in the message)
BAD: list[tuple[str, str, Any, int, str | None, list[str]]] = [
    ("too long", "completions", {"prompt": [1] * 2100}, 400, None, ["2100", "2048"]),
    ("max_tokens 0 without echo", "completions", {"prompt": "hi", "max_tokens": 0}, 400,
     "max_tokens", []),
    ("max_tokens <0", "chat/completions", {"messages": CHAT, "max_tokens": -3}, 400,
     "max_tokens", []),
    ("temperature", "completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", []),
    ("top_p", "completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p", []),
    ("NaN", "completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature",
     ["finite"]),
    ("Infinity", "chat/completions", (b'{"messages": [{"role": "user", "content": "hi"}], '
                                       b'"presence_penalty": -Infinity}'), 400,
     "presence_penalty", ["finite"]),
    ("empty prompt", "completions", {"prompt": ""}, 400, None, ["empty"]),
    ("no prompts", "completions", {"prompt": []}, 400, "prompt", ["empty"]),
    ("empty messages", "chat/completions", {"messages": []}, 400, "messages", ["empty"]),
    ("out of vocab", "completions", {"prompt": [1, 49152]}, 400, None, ["vocabulary"]),
    ("bad JSON", "completions", b'{"prompt": "hi"', 400, None, ["JSON"]),
    ("suffix", "completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix", ["unsupported"]),
    ("logit_bias out of vocab", "completions", {"prompt": "hi", "logit_bias": {"49152": 2}},
     400, None, ["logit_bias", "vocabulary"]),
    ("functions", "chat/completions", {"messages": CHAT, "functions": []}, 400, "functions",
     ["unsupported"]),  # OpenAI's deprecated form of tools
    ("unknown model", "completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model",
     ["gpt-9"]),
    ("over the body limit", "completions", BIG, 413, None, ["limit"]),
]


def check_error(r: httpx.Response, status: int, param: str | None, words: list[str]) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    for word in words:
        assert word in err["message"], err


def test_bad_requests_get_openai_errors_while_a_stream_completes(
        http_stack: LiveStack, offline: Any) -> None:
    expected = offline.generate([PROMPTS[0]], greedy(16), use_tqdm=False)[0].outputs[0].text

    async def run() -> str:
        stream = await async_client(http_stack).completions.create(
            model="smollm2", prompt=PROMPTS[0], max_tokens=16, temperature=0.0, stream=True)
        parts = [(await stream.__anext__()).choices[0].text]  # in flight from here on
        async with httpx.AsyncClient(base_url=http_stack.http, timeout=60) as http:
            for name, path, body, status, param, words in BAD:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                r = await http.post(f"/{path}", content=content,
                                    headers={"content-type": "application/json"})
                check_error(r, status, param, words)
        parts += [chunk.choices[0].text async for chunk in stream]
        return "".join(parts)

    assert asyncio.run(run()) == expected
    with pytest.raises(openai.BadRequestError):
        sync_client(http_stack).completions.create(model="smollm2", prompt="hi", suffix="x")
    with pytest.raises(openai.NotFoundError):
        sync_client(http_stack).completions.create(model="gpt-9", prompt="hi")


def test_full_queue_answers_503_with_retry_after(http_stack: LiveStack) -> None:
    start = len(http_stack.log())

    async def run() -> None:
        async with httpx.AsyncClient(base_url=http_stack.http, timeout=120) as http:
            async def long_stream(i: int) -> Any:
                cm = http.stream("POST", "/completions", json={**LONG, "stream": True})
                response = await cm.__aenter__()
                assert response.status_code == 200
                lines = response.aiter_lines()
                await lines.__anext__()  # running: it produced a token
                # keep the line iterator: a collected one closes the response (a disconnect)
                return cm, lines

            streams = [await long_stream(i) for i in range(2)]  # max_num_seqs 2: both run
            running = [cm for cm, _ in streams]
            short = {"prompt": "Hi", "max_tokens": 2, "temperature": 0.0}
            # one of these waits (max_queued_requests 1), the other is refused at once
            posts = [asyncio.ensure_future(http.post("/completions", json=short))
                     for _ in range(2)]
            done, pending = await asyncio.wait(posts, timeout=60,
                                               return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1 and len(pending) == 1
            refused = done.pop().result()
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "overloaded"
            for cm in running:  # the waiting one runs once a slot frees
                await cm.__aexit__(None, None, None)
            assert (await pending.pop()).status_code == 200

    asyncio.run(run())
    assert_idle_and_clean(http_stack, start)


def test_client_closing_the_stream_aborts_and_frees_blocks(http_stack: LiveStack) -> None:
    start = len(http_stack.log())
    with httpx.stream("POST", f"{http_stack.http}/completions", json={**LONG, "stream": True},
                      timeout=120) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")  # tokens are flowing; then hang up
    http_stack.wait_for_log(lambda t: "the client closed the stream; aborted 1 request(s)" in t,
                            after=start)
    assert_idle_and_clean(http_stack, start)
    # the same for a client that gives up before a non-streamed answer
    start = len(http_stack.log())
    with pytest.raises(openai.APITimeoutError):
        openai.OpenAI(base_url=http_stack.http, api_key="x", max_retries=0, timeout=3
                      ).completions.create(model="smollm2", prompt=LONG["prompt"],
                                           max_tokens=1500, extra_body={"ignore_eos": True})
    http_stack.wait_for_log(lambda t: "the client disconnected before the answer" in t,
                            after=start)
    assert_idle_and_clean(http_stack, start)


def running_at_scheduler(stack: LiveStack) -> int:
    """The scheduler's running count as /metrics shows it (refreshed about every second)."""
    for line in httpx.get(f"{root(stack)}/metrics").text.splitlines():
        if line.startswith("pagoda:num_requests_running "):
            return int(float(line.split()[1]))
    return -1


async def poll_until(condition: Any, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)  # polling an observable condition, not synchronising


def test_engine_death_fails_in_flight_requests_with_engine_error(http_stack: LiveStack) -> None:
    """Last: it kills the worker, which ends this module's stack."""

    async def run() -> None:
        async with httpx.AsyncClient(base_url=http_stack.http, timeout=120) as http:
            async with http.stream("POST", "/completions", json={**LONG, "stream": True}) as r:
                lines = r.aiter_lines()
                assert (await lines.__anext__()).startswith("data: {")
                whole = asyncio.ensure_future(http.post("/chat/completions", json={
                    "messages": CHAT, "max_tokens": 1500, "ignore_eos": True}))
                await poll_until(lambda: running_at_scheduler(http_stack) == 2)
                os.kill(http_stack.pids["worker-0"], signal.SIGKILL)
                events = [line async for line in lines if line]
            assert events[-1] == "data: [DONE]"
            error = json.loads(events[-2].removeprefix("data: "))["error"]
            assert (error["type"], error["code"]) == ("engine_error", "engine_error"), error
            answer = await whole
            assert answer.status_code == 500, answer.text
            assert answer.json()["error"]["code"] == "engine_error"

    asyncio.run(run())
    assert http_stack.proc.wait(timeout=120) == 1  # a dead worker takes the stack down
