"""The frontend process end to end against a fake scheduler (tests/support/fake_scheduler.py).

A real ``python -m services.tokenizer.main`` serves SmolLM2's tokenizer (no weights are
loaded) with max_model_len 64; the fake scheduler answers each AddRequest with scripted
token ids. Covered: typed validation errors that never reach the scheduler, streamed
deltas that concatenate to the final text (Chinese, emoji), stop strings (text cut,
per-sample abort upstream), cancel/timeout/disconnect aborts, malformed frames dropped
and counted, SIGTERM.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq

from pagoda.client import (
    Client,
    InvalidRequestError,
    OverloadedError,
    RequestTimeoutError,
)
from shared.codec import decode, encode
from shared.protocol import (
    AddRequest,
    ChatMessage,
    EngineOutputs,
    GenerateRequest,
    RequestError,
)
from shared.sampling_params import SamplingParams, StructuredOutputsParams
from support.fake_scheduler import Script, wait_until
from support.frontend_proc import REPO_ROOT, FrontendStack, start_frontend

MAX_MODEL_LEN = 64
MULTIBYTE = "北京是中国的首都 🐉🏯🎉 👨‍👩‍👧 café"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path) -> Iterator[FrontendStack]:
    s = start_frontend(smollm2_dir, env={"PAGODA_MAX_MODEL_LEN": str(MAX_MODEL_LEN)})
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture
def client(stack: FrontendStack) -> Iterator[Client]:
    with Client(stack.native, timeout=20) as c:
        yield c


def ids_of(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text)["input_ids"])


def raw_request(address: str, frames: list[bytes], timeout_s: float = 10.0) -> Any:
    """Send frames from a bare DEALER and decode the one reply (None when none came)."""
    ctx: zmq.Context[Any] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send_multipart(frames)
        if not sock.poll(int(timeout_s * 1000)):
            return None
        return decode(sock.recv())
    finally:
        sock.close()
        ctx.term()


# -- validation ------------------------------------------------------------------------------

def _req(**kw: Any) -> GenerateRequest:
    params = kw.pop("params", SamplingParams())
    return GenerateRequest("bad-1", params, **kw)


INVALID = {
    "nothing": _req(),
    "prompt_and_ids": _req(prompt="hi", prompt_token_ids=[1, 2]),
    "empty_prompt": _req(prompt=""),
    "empty_ids": _req(prompt_token_ids=[]),
    "empty_messages": _req(messages=[]),
    "id_out_of_vocab": _req(prompt_token_ids=[1, 49152]),
    "too_long": _req(prompt_token_ids=[5] * MAX_MODEL_LEN),
    "max_tokens_over": _req(prompt_token_ids=[5] * 10, params=SamplingParams(max_tokens=55)),
    "min_tokens_over_default": _req(prompt_token_ids=[5] * 60,
                                    params=SamplingParams(max_tokens=None, min_tokens=5)),
    "stop_token_out_of_vocab": _req(prompt="hi", params=SamplingParams(stop_token_ids=[10**6])),
    "chat_renders_too_long": _req(messages=[ChatMessage("user", "hello world " * 40)]),
    # structured output: the frontend builds the grammar (xgrammar) before sending anything
    "bad_regex": _req(prompt="hi", params=SamplingParams(
        structured_outputs=StructuredOutputsParams(regex="(unclosed"))),
    "bad_schema": _req(prompt="hi", params=SamplingParams(
        structured_outputs=StructuredOutputsParams(json='{"type": "objectx"}'))),
    "bad_grammar": _req(prompt="hi", params=SamplingParams(
        structured_outputs=StructuredOutputsParams(grammar="root ::= undefined"))),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_requests_get_typed_errors_and_never_reach_the_scheduler(
    stack: FrontendStack, case: str
) -> None:
    before = len(stack.scheduler.adds)
    reply = raw_request(stack.native, [encode(INVALID[case])])
    assert isinstance(reply, RequestError), reply
    assert reply.request_id == "bad-1" and reply.code == "invalid_request", reply
    assert len(stack.scheduler.adds) == before


@pytest.mark.parametrize("body", [
    {"structured_outputs": {"regex": "(unclosed"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                "schema": {"type": "objectx"}}}},
    {"guided_grammar": "root ::= undefined"},
    {"guided_json": "{not json"},
])
def test_invalid_constraints_are_http_400_and_never_reach_the_scheduler(
        stack: FrontendStack, body: dict[str, Any]) -> None:
    before = len(stack.scheduler.adds)
    r = httpx.post(f"http://127.0.0.1:{stack.http_port}/v1/completions",
                   json={"prompt": "hi", "max_tokens": 4, **body}, timeout=20)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert len(stack.scheduler.adds) == before


def test_a_constraint_reaches_the_scheduler_as_sent(stack: FrontendStack, client: Client) -> None:
    stack.scheduler.script_for = lambda add: Script([[70, 71]])
    client.generate("hi", max_tokens=4, structured_outputs={"json": {"type": "object"}})
    so = stack.scheduler.adds[-1][1].sampling_params.structured_outputs
    assert so == StructuredOutputsParams(json='{"type": "object"}')


def test_too_long_error_names_both_numbers(client: Client) -> None:
    with pytest.raises(InvalidRequestError) as e:
        client.generate(list(range(10, 10 + MAX_MODEL_LEN + 6)))
    assert str(MAX_MODEL_LEN + 6) in str(e.value) and str(MAX_MODEL_LEN) in str(e.value)
    assert e.value.code == "invalid_request"


def test_max_tokens_defaults_to_the_room_left(stack: FrontendStack, client: Client) -> None:
    prompt = [7, 8, 9, 10, 11]
    client.generate(prompt, max_tokens=None)
    add = stack.scheduler.add_for(prompt)
    assert add is not None and add.sampling_params.max_tokens == MAX_MODEL_LEN - len(prompt)


# -- streaming and text ----------------------------------------------------------------------

def test_streamed_deltas_concatenate_to_the_final_text(
    stack: FrontendStack, client: Client, tokenizer: Any
) -> None:
    out_ids = ids_of(tokenizer, MULTIBYTE)
    assert tokenizer.decode(out_ids) == MULTIBYTE
    stack.scheduler.script_for = lambda add: Script([out_ids], tokens_per_step=1)
    deltas = list(client.stream("Say something", max_tokens=40, n=2))
    for index in (0, 1):
        mine = [d for d in deltas if d.index == index]
        assert "".join(d.text for d in mine) == MULTIBYTE
        assert all("\ufffd" not in d.text for d in mine)
        assert [t for d in mine for t in d.token_ids] == out_ids
        assert mine[-1].finish_reason == "length" and mine[-1].num_output_tokens == len(out_ids)
    final = client.generate("Say something", max_tokens=40)
    assert final.outputs[0].text == MULTIBYTE and final.outputs[0].token_ids == out_ids
    assert final.usage.prompt_tokens == len(ids_of(tokenizer, "Say something"))
    assert final.usage.completion_tokens == len(out_ids)


def test_chat_messages_use_the_chat_template(stack: FrontendStack, client: Client,
                                             tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    stack.scheduler.script_for = lambda add: Script([[65, 66]])
    client.generate(messages=messages, max_tokens=4)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert stack.scheduler.add_for(ids_of(tokenizer, rendered)) is not None


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_text_and_aborts_that_sample(
    stack: FrontendStack, client: Client, tokenizer: Any, include: bool
) -> None:
    with_stop = ids_of(tokenizer, "你好 STOP 世界 and more")
    without = ids_of(tokenizer, "你好 世界 and more")
    stack.scheduler.script_for = lambda add: Script([with_stop, without])
    result = client.generate("stop test", max_tokens=40, n=2, stop=["STOP"],
                             include_stop_str_in_output=include)
    s0, s1 = result.outputs
    assert s0.text == ("你好 STOP" if include else "你好 ")
    assert (s0.finish_reason, s0.stop_reason) == ("stop", "STOP")
    assert s1.text == "你好 世界 and more" and s1.finish_reason == "length"
    add = stack.scheduler.add_for(ids_of(tokenizer, "stop test"))
    assert add is not None
    assert stack.scheduler.wait_for(lambda: stack.scheduler.aborted(add.request_id, index=0))
    assert not stack.scheduler.aborted(add.request_id, index=1)


def test_logprobs_and_cached_tokens_reach_the_client(stack: FrontendStack, client: Client) -> None:
    stack.scheduler.script_for = lambda add: Script([[70, 71, 72]], num_cached_tokens=16)
    result = client.generate([5, 6, 7], max_tokens=8, logprobs=1)
    out = result.outputs[0]
    assert out.token_ids == [70, 71, 72]
    assert out.logprobs is not None and [lp.top_token_ids for lp in out.logprobs] == [[70], [71], [72]]
    assert result.usage.cached_tokens == 16


def test_scheduler_rejection_is_forwarded_typed(stack: FrontendStack, client: Client) -> None:
    stack.scheduler.script_for = lambda add: Script([[1]], error=("overloaded", "queue full"))
    with pytest.raises(OverloadedError, match="queue full"):
        client.generate([5, 6], max_tokens=2)


# -- aborts ----------------------------------------------------------------------------------

def _forever(add: AddRequest) -> Script:
    return Script([[65, 66, 67]], forever=True)


def test_closing_a_stream_early_aborts_at_the_scheduler(stack: FrontendStack, client: Client) -> None:
    stack.scheduler.script_for = _forever
    prompt = [11, 12, 13, 14]
    stream = client.stream(prompt, max_tokens=50)
    for _, delta in zip(range(3), stream):
        assert delta.finish_reason is None
    stream.close()  # type: ignore[attr-defined]
    add = stack.scheduler.add_for(prompt)
    assert add is not None
    assert stack.scheduler.wait_for(lambda: stack.scheduler.aborted(add.request_id, index=None))
    assert stack.scheduler.wait_for(lambda: stack.scheduler.num_running == 0)


def test_timeout_raises_and_aborts(stack: FrontendStack, client: Client) -> None:
    stack.scheduler.script_for = _forever
    prompt = [21, 22, 23]
    with pytest.raises(RequestTimeoutError):
        client.generate(prompt, max_tokens=50, timeout=0.3)
    add = stack.scheduler.add_for(prompt)
    assert add is not None
    assert stack.scheduler.wait_for(lambda: stack.scheduler.aborted(add.request_id))


KILLED_CLIENT = """
import sys
from pagoda.client import Client
c = Client(sys.argv[1], timeout=60)
for i, delta in enumerate(c.stream([31, 32, 33], max_tokens=50)):
    if i == 0:
        print("streaming", flush=True)
"""


def test_client_killed_mid_stream_is_aborted_at_the_scheduler(stack: FrontendStack) -> None:
    stack.scheduler.script_for = _forever
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, stack.native], cwd=REPO_ROOT,
                            stdout=subprocess.PIPE, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready and proc.stdout.readline() == b"streaming\n"
        proc.kill()
        proc.wait()
        add = stack.scheduler.add_for([31, 32, 33])
        assert add is not None
        assert stack.scheduler.wait_for(lambda: stack.scheduler.aborted(add.request_id))
        assert stack.scheduler.wait_for(lambda: stack.scheduler.num_running == 0)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert wait_until(lambda: "disconnected: aborted its 1 request(s)" in stack.log())


# -- malformed frames ------------------------------------------------------------------------

def test_malformed_frames_are_dropped_counted_and_the_next_request_served(
    stack: FrontendStack, client: Client
) -> None:
    valid = encode(GenerateRequest("m-1", SamplingParams(max_tokens=2), prompt_token_ids=[1, 2]))
    bad = {
        "msgpack": [b"\xc1 garbage bytes"],  # 0xc1 is never valid msgpack
        "arity": [msgspec.msgpack.encode([1, [8, "only-an-id"]])],  # a valid envelope, wrong shape
        "unexpected_kind": [encode(EngineOutputs([]))],
        "frame_count": [valid, valid],
    }
    truncated = [valid[: len(valid) // 2]]
    for frames in [*bad.values(), truncated]:
        assert raw_request(stack.native, frames, timeout_s=0.2) is None
    for reason in bad:
        assert wait_until(
            lambda reason=reason: f"dropped malformed frame on frontend_native ({reason})" in stack.log()
        ), stack.log()
    stack.scheduler.script_for = lambda add: Script([[65, 66]])
    assert client.generate([1, 2], max_tokens=2).outputs[0].token_ids == [65, 66]
    assert stack.proc.poll() is None


# -- shutdown --------------------------------------------------------------------------------

def test_sigterm_aborts_in_flight_requests_and_exits_cleanly(smollm2_dir: Path) -> None:
    s = start_frontend(smollm2_dir, env={"PAGODA_SHUTDOWN_TIMEOUT_S": "0"})
    try:
        s.scheduler.script_for = _forever
        with Client(s.native, timeout=20) as c:
            stream = c.stream([41, 42], max_tokens=50)
            first = next(stream)
            assert first.finish_reason is None
            s.proc.send_signal(signal.SIGTERM)
            rest = list(stream)
            assert rest and rest[-1].finish_reason == "abort"
        assert s.proc.wait(timeout=20) == 0, s.log()
        add = s.scheduler.add_for([41, 42])
        assert add is not None and s.scheduler.aborted(add.request_id)
        assert not s.native_path.exists()
    finally:
        s.stop()


def test_sigterm_when_idle_exits_zero_quickly(smollm2_dir: Path) -> None:
    s = start_frontend(smollm2_dir)
    try:
        start = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=20) == 0, s.log()
        assert time.monotonic() - start < 10
        assert not s.native_path.exists()
    finally:
        s.stop()
