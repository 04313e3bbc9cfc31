"""Malformed frames are rejected with a reason, and safe_decode drops and counts them."""

from __future__ import annotations

import datetime
import logging
import math
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.codec import (
    WIRE_VERSION,
    DecodeError,
    MalformedFrameCounter,
    decode,
    encode,
    safe_decode,
)
from shared.protocol import (
    ANY_MESSAGE,
    FRONTEND_TO_SCHEDULER,
    MESSAGE_TYPES,
    AbortRequest,
    AddRequest,
    EngineOutput,
    EngineOutputs,
    EngineStats,
    Histogram,
    StepBatch,
    StepResult,
    TokenLogprobs,
    WorkerReady,
)
from shared.sampling_params import SamplingParams
from wire_samples import samples, step_batch

ADD = AddRequest("r", [1, 2], SamplingParams(), 1.0)
ADD_TAG = AddRequest.__struct_config__.tag
FRONTEND_IN = FRONTEND_TO_SCHEDULER  # AddRequest | AbortRequest | Heartbeat
pack = msgspec.msgpack.encode  # raw msgpack, for frames our encoder would never write


def mutated(msg: Any, edit: Callable[[list[Any]], None]) -> bytes:
    """``msg``'s frame with its fields edited (a valid envelope of the wrong shape).

    ``edit`` sees the message's fields without the tag, so index i is field i."""
    version, (tag, *fields) = msgspec.msgpack.decode(encode(msg))
    edit(fields)
    return pack([version, [tag, *fields]])


def setter(*path: int, value: Any) -> Callable[[list[Any]], None]:
    def edit(payload: list[Any]) -> None:
        target = payload
        for i in path[:-1]:
            target = target[i]
        target[path[-1]] = value

    return edit


def envelope(version: Any, kind: Any, fields: list[Any]) -> bytes:
    return pack([version, [kind, *fields]])


def spliced(msg: Any, old: bytes, new: bytes) -> bytes:
    """``msg``'s frame with some bytes replaced (values msgspec cannot write)."""
    frame = encode(msg)
    assert frame.count(old) == 1
    return frame.replace(old, new)


BAD_FRAMES: dict[str, tuple[bytes, str]] = {
    # name: (frame, reason)
    "empty": (b"", "msgpack"),
    "garbage": (b"\xc1\xff\x00garbage", "msgpack"),
    "truncated": (encode(ADD)[:-3], "msgpack"),
    "trailing bytes": (encode(ADD) + b"\x00", "msgpack"),
    "invalid utf-8": (spliced(AddRequest("\x01\x02", [], SamplingParams(), 1.0),
                              b"\xa2\x01\x02", b"\xa2\xff\xfe"), "msgpack"),
    "ext type": (mutated(ADD, setter(0, value=msgspec.msgpack.Ext(5, b"x"))), "type"),
    "timestamp": (mutated(ADD, setter(3, value=datetime.datetime.now(datetime.UTC))), "type"),
    "ext envelope": (pack(msgspec.msgpack.Ext(1, b"\x01")), "envelope"),
    "map envelope": (pack({"kind": 1}), "envelope"),
    "map body": (pack([WIRE_VERSION, {"request_id": "r"}]), "envelope"),
    "map field": (mutated(ADD, setter(2, value={"n": 1})), "type"),
    "deep nesting": (b"\x91" * 100_000, "envelope"),
    "deep nesting in a field": (spliced(ADD, b"\xa1r", b"\x91" * 100_000 + b"\x90"), "type"),
    "scalar envelope": (pack(7), "envelope"),
    "two-item envelope": (pack([WIRE_VERSION, 1]), "envelope"),
    "old three-item envelope": (pack([WIRE_VERSION, ADD_TAG, ["r"]]), "envelope"),
    "wrong version": (envelope(WIRE_VERSION + 1, ADD_TAG, []), "version"),
    "string version": (envelope("1", ADD_TAG, []), "version"),
    "unknown kind": (envelope(WIRE_VERSION, 99, []), "kind"),
    "kind as class name": (envelope(WIRE_VERSION, "AddRequest", []), "kind"),
    "bool kind": (envelope(WIRE_VERSION, True, []), "kind"),
    "no kind": (pack([WIRE_VERSION, []]), "arity"),
    "unexpected kind": (encode(StepBatch(1)), "unexpected_kind"),
    "payload not array": (pack([WIRE_VERSION, "r"]), "envelope"),
    "too few fields": (mutated(ADD, lambda p: p.__delitem__(slice(2, None))), "arity"),
    "too many fields": (mutated(ADD, lambda p: p.append(0)), "arity"),
    "id not str": (mutated(ADD, setter(0, value=17)), "type"),
    "arrival not float": (mutated(ADD, setter(3, value="now")), "type"),
    "arrival nan": (mutated(ADD, setter(3, value=math.nan)), "range"),
    "priority bool": (mutated(ADD, setter(4, value=True)), "type"),
    "priority over int64": (mutated(ADD, setter(4, value=2**64 - 1)), "range"),
    "ids as packed bytes": (mutated(ADD, setter(1, value=b"\x01\x00\x00\x00")), "type"),
    "ids as str": (mutated(ADD, setter(1, value="\x01\x00\x00\x00")), "type"),
    "packed length": (mutated(ADD, setter(1, value=b"\x01\x00\x00\x00\x02")), "type"),
    "negative id": (mutated(ADD, setter(1, value=[5, -1])), "range"),
    "id over int32": (mutated(ADD, setter(1, value=[5, 2**31])), "range"),
    "id float": (mutated(ADD, setter(1, value=[5, 1.0])), "type"),
    "id bool": (mutated(ADD, setter(1, value=[True])), "type"),
    "id null": (mutated(ADD, setter(1, value=[None])), "type"),
    "id over uint64": (spliced(ADD, b"\x92\x01\x02", b"\x92\x01\xd3\x80" + b"\x00" * 7),
                       "range"),
    "request id over the length limit": (mutated(ADD, setter(0, value="x" * (2**20 + 1))),
                                         "range"),
    "params as str": (mutated(ADD, setter(2, value="greedy")), "type"),
    "params arity": (mutated(ADD, lambda p: p[2].append(0)), "arity"),
    "params junk of the right length": (mutated(ADD, setter(2, value=[1] * 16)), "type"),
    "temperature < 0": (mutated(ADD, setter(2, 1, value=-1.0)), "value"),
    "top_p 0": (mutated(ADD, setter(2, 2, value=0.0)), "value"),
    "n 0": (mutated(ADD, setter(2, 0, value=0)), "value"),
    "temperature inf": (mutated(ADD, setter(2, 1, value=math.inf)), "range"),
    "stop not list": (mutated(ADD, setter(2, 9, value="\n")), "type"),
    "stop item not str": (mutated(ADD, setter(2, 9, value=[1])), "type"),
    "ignore_eos int": (mutated(ADD, setter(2, 12, value=1)), "type"),
}

FRONTEND_ONLY = {"unexpected kind"}

NESTED_BAD: dict[str, tuple[bytes, str]] = {
    "output not array": (mutated(EngineOutputs([EngineOutput("r", 0, [1])]),
                                 setter(0, 0, value="x")), "type"),
    "output index negative": (mutated(EngineOutputs([EngineOutput("r", 0, [1])]),
                                      setter(0, 0, 1, value=-1)), "range"),
    "logprob +inf": (mutated(StepResult(1, [0], [1], [TokenLogprobs(-1.0, 1, [], [])]),
                             setter(3, 0, 0, value=math.inf)), "range"),
    "logprob nan": (mutated(StepResult(1, [0], [1], [TokenLogprobs(-1.0, 1, [], [])]),
                            setter(3, 0, 0, value=math.nan)), "range"),
    "top lists differ": (mutated(StepResult(1, [0], [1], [TokenLogprobs(-1.0, 1, [], [])]),
                                 setter(3, 0, 3, value=[-2.0])), "value"),
    "step result lengths": (mutated(StepResult(1, [0], [1]), setter(2, value=[])), "value"),
    "step result logprob count": (mutated(StepResult(1, [0], [1], [None]),
                                          setter(3, value=[None, None])), "value"),
    "output logprob count": (mutated(EngineOutputs([EngineOutput("r", 0, [1], [None])]),
                                     setter(0, 0, 3, value=[None, None])), "value"),
    "stats kv usage inf": (mutated(EngineStats(0, 0, 0.0, 1, 0, 0, 0, 0, 0, 0, 0, 0,
                                               *[Histogram([], [0], 0.0, 0)] * 4, 0),
                                   setter(2, value=math.inf)), "range"),
    "step id negative": (mutated(StepBatch(0), setter(0, value=-1)), "range"),
    "batch lengths": (mutated(StepBatch(0), setter(3, value=[0])), "value"),
    "batch with a string seq id": (mutated(step_batch(), setter(3, 0, value="a1b2c3/req-7-0")),
                                   "type"),
    "batch with a negative seq id": (mutated(step_batch(), setter(5, value=[-1])), "range"),
    "new request computed > tokens": (mutated(step_batch(), setter(1, 0, 5, value=10**6)),
                                      "value"),
    "new request wrong params": (mutated(step_batch(), setter(1, 0, 3, 0, value=0)), "value"),
    "running request wrong type": (mutated(step_batch(), setter(2, 0, value=None)), "type"),
    "worker ready negative": (mutated(WorkerReady(0, 1, 1, 1, 1, []), setter(1, value=-8)),
                              "range"),
    "abort ids not strings": (mutated(AbortRequest(["a"]), setter(0, value=[b"a"])), "type"),
}


@pytest.mark.parametrize("name", sorted(BAD_FRAMES))
def test_frontend_socket_rejects(name: str) -> None:
    frame, reason = BAD_FRAMES[name]
    with pytest.raises(DecodeError) as info:
        decode(frame, FRONTEND_IN)
    assert info.value.reason == reason, str(info.value)
    assert str(info.value)  # says why
    counter = MalformedFrameCounter()
    assert safe_decode([b"frontend-1", frame], FRONTEND_IN, counter, num_frames=2) is None
    assert counter.count("scheduler_frontend", reason) == 1 and counter.count() == 1


def test_ints_are_widened_to_floats() -> None:
    # msgspec accepts an int where a float goes (the old codec refused it as "type"):
    # lossless, and still range-checked (an int is always finite)
    back = decode(mutated(ADD, setter(3, value=1)), FRONTEND_IN)
    assert back.arrival_time == 1.0 and type(back.arrival_time) is float


@pytest.mark.parametrize("name", sorted(NESTED_BAD))
def test_nested_shapes_rejected(name: str) -> None:
    frame, reason = NESTED_BAD[name]
    with pytest.raises(DecodeError) as info:
        decode(frame)
    assert info.value.reason == reason, str(info.value)
    counter = MalformedFrameCounter()
    assert safe_decode([frame], ANY_MESSAGE, counter, socket_name="worker.step") is None
    assert counter.snapshot() == {("worker.step", reason): 1}


@pytest.mark.parametrize("frames", [[], [b"a"], [b"a", b"b", encode(ADD)]])
def test_wrong_frame_count_is_dropped(frames: list[bytes]) -> None:
    counter = MalformedFrameCounter()
    assert safe_decode(frames, ANY_MESSAGE, counter, num_frames=2, socket_name="sock") is None
    assert counter.count("sock", "frame_count") == 1


def test_non_bytes_frames_do_not_raise() -> None:
    counter = MalformedFrameCounter()
    for frame in (None, 17, "text", [1, 2]):
        assert safe_decode([frame], ANY_MESSAGE, counter, socket_name="sock") is None
    assert counter.count("sock", "type") == 4
    with pytest.raises(DecodeError) as info:
        decode("text")  # type: ignore[arg-type]
    assert info.value.reason == "type"


def test_valid_frames_still_decode_after_drops() -> None:
    counter = MalformedFrameCounter()
    assert safe_decode([b"junk"], ANY_MESSAGE, counter) is None
    for msg in samples():
        assert safe_decode([encode(msg)], ANY_MESSAGE, counter) == msg
    assert counter.count() == 1


def test_logging_is_rate_limited_and_shows_only_a_prefix(caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    counter = MalformedFrameCounter(log_interval_s=10.0, clock=lambda: now[0])
    secret = b"\xc1" + b"SECRET-PROMPT-TEXT" * 10
    with caplog.at_level(logging.WARNING, logger="pagoda.wire"):
        for _ in range(50):
            safe_decode([secret], ANY_MESSAGE, counter, socket_name="sched")
        now[0] += 11.0
        safe_decode([secret], ANY_MESSAGE, counter, socket_name="sched")
    assert counter.count("sched", "msgpack") == 51
    assert len(caplog.records) == 2  # the first drop, then one per interval
    text = caplog.text
    assert secret[:16].hex() in text and "SECRET-PROMPT-TEXT" not in text
    assert secret[:17].hex() not in text
    assert "49 more dropped" in text


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.binary(max_size=256), max_size=3))
def test_random_bytes_never_raise(frames: list[bytes]) -> None:
    counter = MalformedFrameCounter(logger=logging.getLogger("fuzz.quiet"))
    result = safe_decode(frames, ANY_MESSAGE, counter)
    assert result is None or type(result) in MESSAGE_TYPES
    assert counter.count() == (0 if result is not None else 1)


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64 - 1) | st.floats()
    | st.text(max_size=8) | st.binary(max_size=12),
    lambda children: st.lists(children, max_size=6),
    max_leaves=30,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([cls.__struct_config__.tag for cls in MESSAGE_TYPES]), msgpack_values)
def test_random_payloads_in_valid_envelopes_never_raise(kind: int, payload: Any) -> None:
    try:
        frame = envelope(WIRE_VERSION, kind, payload if isinstance(payload, list) else [payload])
    except (OverflowError, ValueError, TypeError):
        return  # not representable in msgpack
    counter = MalformedFrameCounter(logger=logging.getLogger("fuzz.quiet"))
    result = safe_decode([frame], ANY_MESSAGE, counter)
    if result is None:
        assert counter.count() == 1 and counter.count(reason="internal") == 0
