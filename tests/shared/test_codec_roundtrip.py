"""Every wire message survives encode -> decode unchanged, in the documented frame layout."""

from __future__ import annotations

import msgspec
import pytest
import zmq

from shared.codec import (
    WIRE_VERSION,
    DecodeError,
    EncodeError,
    MalformedFrameCounter,
    decode,
    encode,
    safe_decode,
)
from shared.protocol import (
    ANY_MESSAGE,
    LINKS,
    MESSAGE_TYPES,
    SCHEDULER_TO_FRONTEND,
    AddRequest,
    EngineOutputs,
    StepBatch,
    StepResult,
)
from shared.sampling_params import SamplingParams
from wire_samples import INT32_MAX, samples, step_batch

raw = msgspec.msgpack.decode  # a frame as plain msgpack values
pack = msgspec.msgpack.encode


def tag_of(cls: type) -> int:
    return cls.__struct_config__.tag  # type: ignore[attr-defined]


@pytest.mark.parametrize("msg", samples(), ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    frame = encode(msg)
    assert isinstance(frame, bytes)
    back = decode(frame)
    assert type(back) is type(msg)
    assert back == msg
    links = [link for link in LINKS if type(msg) in link.types]
    assert links, f"{type(msg).__name__} travels on no link"
    for link in links:
        assert decode(frame, link) == msg
    memory = memoryview(bytearray(frame))  # as a zmq.Frame (copy=False) hands it over
    assert decode(memory, links[0]) == msg


def test_every_top_level_type_has_a_sample_and_a_unique_kind() -> None:
    assert {type(m) for m in samples()} == set(MESSAGE_TYPES) == set(ANY_MESSAGE.types)
    tags = [tag_of(cls) for cls in MESSAGE_TYPES]
    assert len(set(tags)) == len(tags) and all(type(t) is int for t in tags)
    # the kind numbers of the first codec, kept as the tags
    assert {cls.__name__: tag_of(cls) for cls in MESSAGE_TYPES} == {
        "AddRequest": 1, "AbortRequest": 2, "EngineOutputs": 3, "RequestError": 4,
        "StepBatch": 5, "StepResult": 6, "WorkerReady": 7, "GenerateRequest": 8,
        "GenerateOutput": 9, "Heartbeat": 10, "EngineStats": 11, "WorkerHeartbeat": 12,
    }


def test_each_link_refuses_the_other_links_messages() -> None:
    for link in LINKS:
        for msg in samples():
            if type(msg) in link.types:
                continue
            with pytest.raises(DecodeError) as info:
                decode(encode(msg), link)
            assert info.value.reason == "unexpected_kind"


def test_frame_layout_is_version_then_tagged_array() -> None:
    msg = AddRequest("r", [1, 256, INT32_MAX], SamplingParams(), 2.5, priority=3)
    version, (kind, *fields) = raw(encode(msg))
    assert (version, kind) == (WIRE_VERSION, tag_of(AddRequest))
    request_id, token_ids, params, arrival, priority = fields
    assert (request_id, arrival, priority) == ("r", 2.5, 3)
    assert token_ids == [1, 256, INT32_MAX]  # plain msgpack ints
    assert isinstance(params, list)  # SamplingParams, untagged, every field
    assert len(params) == len(SamplingParams.__struct_fields__)


def test_int_floats_are_sent_as_floats() -> None:
    # SamplingParams(temperature=0) keeps the int 0; the wire must carry a float
    msg = AddRequest("r", [1], SamplingParams(temperature=0), 1)  # type: ignore[arg-type]
    back = decode(encode(msg))
    assert type(back.sampling_params.temperature) is float and back.sampling_params.is_greedy
    assert type(back.arrival_time) is float


def test_decoder_fills_defaults_of_missing_trailing_fields() -> None:
    # a frame from a peer that predates AddRequest.priority: new decoders read it
    params_fields = raw(encode(AddRequest("x", [], SamplingParams(), 1.0)))[1][3]
    old = pack([WIRE_VERSION, [tag_of(AddRequest), "r", [], params_fields, 1.0]])
    back = decode(old)
    assert back.priority == 0 and back.request_id == "r"
    assert decode(pack([WIRE_VERSION, [tag_of(StepBatch), 4]])) == StepBatch(4)
    # an older SamplingParams without its last fields (max_tokens, min_tokens, logprobs)
    old = pack([WIRE_VERSION, [tag_of(AddRequest), "r", [], params_fields[:13], 1.0]])
    assert decode(old).sampling_params == SamplingParams()


def test_decoder_refuses_fields_it_does_not_know() -> None:
    # a frame from a newer peer with a field appended: refused, never silently truncated
    version, body = raw(encode(AddRequest("x", [], SamplingParams(), 1.0, priority=2)))
    with pytest.raises(DecodeError) as info:
        decode(pack([version, [*body, "new field"]]))
    assert info.value.reason == "arity"
    body[3].append(0)  # one more SamplingParams field
    with pytest.raises(DecodeError) as info:
        decode(pack([version, body]))
    assert info.value.reason == "arity"


def test_large_batch_round_trip() -> None:
    batch = step_batch(num_running=1024, prompt_len=4096)
    assert decode(encode(batch)) == batch
    result = StepResult(1, list(range(5, 1029)), list(range(1024)), [None] * 1024)
    assert decode(encode(result)) == result


def test_decode_accepts_bytearray_and_memoryview() -> None:
    frame = encode(EngineOutputs([]))
    assert decode(bytearray(frame)) == EngineOutputs([])
    assert decode(memoryview(frame)) == EngineOutputs([])
    counter = MalformedFrameCounter()
    zmq_frame = zmq.Frame(encode(EngineOutputs([])))  # recv_multipart(copy=False) gives these
    assert safe_decode([zmq_frame], SCHEDULER_TO_FRONTEND, counter) == EngineOutputs([])
    assert counter.count() == 0


@pytest.mark.parametrize("bad", [[-1], [2**31], [1.5], ["7"]])
def test_ids_that_do_not_fit_int32_are_refused(bad: list[object]) -> None:
    msg = AddRequest("r", bad, SamplingParams(), 1.0)  # type: ignore[arg-type]
    with pytest.raises(DecodeError) as info:  # by the receiver
        decode(encode(msg))
    assert info.value.reason in ("range", "type")
    with pytest.raises(EncodeError):  # by a sender that asks (pagoda.client does)
        encode(msg, validate=True)


def test_encode_refuses_values_msgpack_cannot_carry() -> None:
    with pytest.raises(EncodeError):
        encode(AddRequest("r", [object()], SamplingParams(), 1.0))  # type: ignore[list-item]
    with pytest.raises(EncodeError):
        encode(AddRequest("r", [2**64], SamplingParams(), 1.0))


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(EncodeError):
        encode({"request_id": "r"})
    with pytest.raises(EncodeError):
        encode(SamplingParams())  # nested only, not a message of its own
