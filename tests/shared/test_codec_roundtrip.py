"""Every wire message survives encode -> decode unchanged, in the documented frame layout."""

from __future__ import annotations

import struct

import msgpack
import pytest
from wire_samples import INT32_MAX, samples, step_batch

from shared.codec import KIND_OF, KINDS, WIRE_VERSION, EncodeError, decode, encode, pack_int32
from shared.protocol import AddRequest, RequestOutputs, StepBatch, StepResult
from shared.sampling_params import SamplingParams


@pytest.mark.parametrize("msg", samples(), ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    frame = encode(msg)
    assert isinstance(frame, bytes)
    back = decode(frame)
    assert type(back) is type(msg)
    assert back == msg
    assert decode(frame, expected=(type(msg),)) == msg


def test_every_top_level_type_has_a_sample_and_a_unique_kind() -> None:
    assert {type(m) for m in samples()} == set(KINDS.values())
    assert len(set(KIND_OF.values())) == len(KINDS)


def test_frame_layout_is_version_kind_compact_array() -> None:
    msg = AddRequest("r", [1, 256, INT32_MAX], SamplingParams(), 2.5, priority=3)
    version, kind, payload = msgpack.unpackb(encode(msg), raw=False)
    assert (version, KINDS[kind]) == (WIRE_VERSION, AddRequest)
    request_id, packed, params, arrival, priority = payload
    assert (request_id, arrival, priority) == ("r", 2.5, 3)
    assert packed == struct.pack("<3i", 1, 256, INT32_MAX)  # little-endian int32
    assert isinstance(params, list) and len(params) == 16


def test_int_floats_are_sent_as_floats() -> None:
    # SamplingParams(temperature=0) keeps the int 0; the wire must carry a float
    msg = AddRequest("r", [1], SamplingParams(temperature=0), 1)  # type: ignore[arg-type]
    back = decode(encode(msg))
    assert type(back.sampling_params.temperature) is float and back.sampling_params.is_greedy
    assert type(back.arrival_time) is float


def test_decoder_fills_defaults_of_missing_trailing_fields() -> None:
    # a frame from a peer that predates AddRequest.priority: new decoders read it
    params_fields = msgpack.unpackb(encode(AddRequest("x", [], SamplingParams(), 1.0)))[2][2]
    old = msgpack.packb([WIRE_VERSION, KIND_OF[AddRequest], ["r", b"", params_fields, 1.0]])
    back = decode(old)
    assert back.priority == 0 and back.request_id == "r"
    assert decode(msgpack.packb([WIRE_VERSION, KIND_OF[StepBatch], [4]])) == StepBatch(4)


def test_large_batch_round_trip() -> None:
    batch = step_batch(num_running=1024, prompt_len=4096)
    assert decode(encode(batch)) == batch
    result = StepResult(1, [f"r{i}" for i in range(1024)], list(range(1024)), [None] * 1024)
    assert decode(encode(result)) == result


def test_decode_accepts_bytearray_and_memoryview() -> None:
    frame = encode(RequestOutputs([]))
    assert decode(bytearray(frame)) == RequestOutputs([])
    assert decode(memoryview(frame)) == RequestOutputs([])


@pytest.mark.parametrize("bad", [[-1], [2**31], [1.5], ["7"]])
def test_encode_refuses_ids_that_do_not_fit_int32(bad: list[object]) -> None:
    with pytest.raises(EncodeError):
        encode(AddRequest("r", bad, SamplingParams(), 1.0))  # type: ignore[arg-type]
    with pytest.raises(EncodeError):
        pack_int32(bad)  # type: ignore[arg-type]


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(EncodeError):
        encode({"request_id": "r"})
    with pytest.raises(EncodeError):
        encode(SamplingParams())  # nested only, not a message of its own
