"""The ZMQ wire codec: every message of ``shared/protocol.py`` <-> one msgpack frame.

Every process encodes with ``encode`` and receives with ``safe_decode`` (which never
raises: a malformed frame is dropped, counted and logged rate-limited).

Frame layout: a msgpack array ``[WIRE_VERSION, kind, payload]``. ``kind`` is a small int
from ``KINDS`` (one explicit table; no class is ever looked up by a wire string).
``payload`` is the dataclass's fields as an array in declaration order; a nested
dataclass is an array the same way. Every ``list[int]`` field (token ids, block ids,
counts) travels as packed little-endian int32 ``bin`` bytes, non-negative.

Schema evolution (append-only, as vLLM's ``array_like`` structs): a new field goes last
and has a default. A decoder fills missing trailing fields from their defaults, so a new
decoder reads an old peer's frames; a frame with more fields than the decoder knows is
rejected (``arity``), never silently truncated. A breaking change bumps WIRE_VERSION.

Decoding is the schema check: each field's type is verified against the dataclass's
annotations, ints are range-checked (non-negative unless listed in ``_SIGNED_INT_FIELDS``),
floats must be finite (logprobs may be -inf), ``SamplingParams`` is rebuilt through its
validating constructor, and a few cross-field invariants (parallel list lengths) are
checked. The per-type field plans are built once at import, so a message costs one
closure call per field and no reflection.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import threading
import time
import types
import typing
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from shared.protocol import (
    AbortRequest,
    AddRequest,
    EngineStats,
    GenerateOutput,
    GenerateRequest,
    Heartbeat,
    NewRequest,
    RequestError,
    RequestOutput,
    RequestOutputs,
    StepBatch,
    StepResult,
    TokenLogprobs,
    WorkerReady,
)
from shared.sampling_params import SamplingParams

WIRE_VERSION = 1

# Hard limits on one frame; sockets set ZMQ_MAXMSGSIZE to MAX_FRAME_BYTES too (shared/ipc.py).
MAX_FRAME_BYTES = 256 * 1024 * 1024
MAX_STR_LEN = 1 << 20  # one string (request id, error message, stop string)
MAX_ARRAY_LEN = 1 << 20  # one array (requests in a batch, logprobs of a step)

# kind tag <-> message type. Append only; never reuse a number.
KINDS: dict[int, type] = {
    1: AddRequest,
    2: AbortRequest,
    3: RequestOutputs,
    4: RequestError,
    5: StepBatch,
    6: StepResult,
    7: WorkerReady,
    8: GenerateRequest,  # client -> frontend (ChatMessage is nested, needs no kind)
    9: GenerateOutput,  # frontend -> client
    10: Heartbeat,  # frontend -> scheduler
    11: EngineStats,  # scheduler -> frontend (Histogram, MalformedCount nested)
}
KIND_OF: dict[type, int] = {cls: kind for kind, cls in KINDS.items()}

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_BIG_ENDIAN = sys.byteorder == "big"
# bytes < 0x80: deleting them from the sign bytes of packed int32s leaves only negatives
_NON_NEGATIVE_SIGN_BYTES = bytes(range(0x80))

# Ints are non-negative on the wire except these (lower priority runs first).
_SIGNED_INT_FIELDS = {(AddRequest, "priority")}
# Floats must be finite except these, which may be -inf (a token the model rules out).
_LOGPROB_FIELDS = {(TokenLogprobs, "logprob"), (TokenLogprobs, "top_logprobs")}
# Types rebuilt through a validating constructor: their ints are signed int64 on the
# wire and the constructor enforces the real ranges.
_SELF_VALIDATING = {SamplingParams}

_UNPACK_OPTIONS: dict[str, Any] = dict(
    raw=False,  # str -> str (strict UTF-8); bin -> bytes
    use_list=True,
    strict_map_key=True,
    max_str_len=MAX_STR_LEN,
    max_bin_len=MAX_FRAME_BYTES,
    max_array_len=MAX_ARRAY_LEN,
    max_map_len=0,  # no message uses a map
    max_ext_len=0,  # no ext types (this also refuses msgpack timestamps)
)


class DecodeError(ValueError):
    """A frame that is not a valid message; ``reason`` is a short label for counters."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EncodeError(ValueError):
    """A message that cannot go on the wire (a bug in the sender)."""


Decoder = Callable[[Any], Any]
Encoder = Callable[[Any], Any]


def _short(value: Any) -> str:
    """A description of a wire value for error messages: its type and a short repr."""
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


# -- scalar decoders -----------------------------------------------------------------------


def _uint_decoder(where: str) -> Decoder:
    def dec(v: Any) -> int:
        if type(v) is not int:
            raise DecodeError("type", f"{where}: expected int, got {_short(v)}")
        if v < 0 or v > _INT64_MAX:
            raise DecodeError("range", f"{where}: must be in [0, 2**63), got {v}")
        return v

    return dec


def _int_decoder(where: str) -> Decoder:
    def dec(v: Any) -> int:
        if type(v) is not int:
            raise DecodeError("type", f"{where}: expected int, got {_short(v)}")
        if v < _INT64_MIN or v > _INT64_MAX:
            raise DecodeError("range", f"{where}: must fit in int64, got {v}")
        return v

    return dec


def _float_decoder(where: str, allow_neg_inf: bool) -> Decoder:
    def dec(v: Any) -> float:
        if type(v) is not float:
            raise DecodeError("type", f"{where}: expected float, got {_short(v)}")
        if not math.isfinite(v) and not (allow_neg_inf and v == -math.inf):
            raise DecodeError("range", f"{where}: must be finite, got {v}")
        return v

    return dec


def _exact_decoder(where: str, tp: type) -> Decoder:
    name = tp.__name__

    def dec(v: Any) -> Any:
        if type(v) is not tp:
            raise DecodeError("type", f"{where}: expected {name}, got {_short(v)}")
        return v

    return dec


def _optional_decoder(inner: Decoder) -> Decoder:
    def dec(v: Any) -> Any:
        return None if v is None else inner(v)

    return dec


def _list_decoder(where: str, inner: Decoder, optional: bool) -> Decoder:
    def dec(v: Any) -> list[Any]:
        if type(v) is not list:
            raise DecodeError("type", f"{where}: expected array, got {_short(v)}")
        try:
            if optional:
                return [None if x is None else inner(x) for x in v]
            return list(map(inner, v))
        except DecodeError as e:
            raise DecodeError(e.reason, f"{where}[]: {e}") from None

    return dec


def _str_list_decoder(where: str) -> Decoder:
    def dec(v: Any) -> list[str]:
        if type(v) is not list:
            raise DecodeError("type", f"{where}: expected array, got {_short(v)}")
        if v and set(map(type, v)) != {str}:  # the type test runs in C, not per element
            raise DecodeError("type", f"{where}: expected an array of str")
        return v

    return dec


def _float_list_decoder(where: str, allow_neg_inf: bool) -> Decoder:
    def dec(v: Any) -> list[float]:
        if type(v) is not list:
            raise DecodeError("type", f"{where}: expected array, got {_short(v)}")
        if not v:
            return v
        if set(map(type, v)) != {float}:
            raise DecodeError("type", f"{where}: expected an array of float")
        # a finite sum means every element is finite; otherwise look at each one
        if not math.isfinite(sum(v)):
            for x in v:
                if not math.isfinite(x) and not (allow_neg_inf and x == -math.inf):
                    raise DecodeError("range", f"{where}: must be finite, got {x}")
        return v

    return dec


# -- packed int32 lists --------------------------------------------------------------------


def pack_int32(values: Sequence[int]) -> bytes:
    """Non-negative ints -> little-endian int32 bytes; EncodeError when one does not fit."""
    if not values:
        return b""  # most running requests gain no block in a step
    try:
        arr = array("i", values)
    except (TypeError, OverflowError) as e:
        raise EncodeError(f"token/block id list: {e}") from None
    if _BIG_ENDIAN:
        arr.byteswap()
    data = arr.tobytes()
    if data[3::4].translate(None, _NON_NEGATIVE_SIGN_BYTES):
        raise EncodeError("token/block id list: negative value")
    return data


def _packed_int32_decoder(where: str) -> Decoder:
    def dec(v: Any) -> list[int]:
        if type(v) is not bytes:
            raise DecodeError("type", f"{where}: expected packed int32 bytes, got {_short(v)}")
        if not v:
            return []
        if len(v) % 4:
            raise DecodeError("packed_length", f"{where}: {len(v)} bytes is not a multiple of 4")
        # the top byte of each little-endian int32 holds the sign bit
        if v[3::4].translate(None, _NON_NEGATIVE_SIGN_BYTES):
            raise DecodeError("range", f"{where}: negative value in a non-negative id list")
        arr = array("i")
        arr.frombytes(v)
        if _BIG_ENDIAN:
            arr.byteswap()
        return arr.tolist()

    return dec


def _encode_floats(values: Sequence[float]) -> list[float]:
    return list(map(float, values))


# -- per-type plans ------------------------------------------------------------------------


class _Plan:
    """How one dataclass goes to and from a wire array; built once per type."""

    def __init__(self, cls: type, plans: dict[type, _Plan]) -> None:
        plans[cls] = self  # registered first, so a (hypothetical) cycle terminates
        self.cls = cls
        self.name = cls.__name__
        fields = dataclasses.fields(cls)
        hints = typing.get_type_hints(cls)
        self.names = tuple(f.name for f in fields)
        self.max_arity = len(fields)
        self.min_arity = sum(
            1
            for f in fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        decoders = tuple(_field_decoder(cls, f.name, hints[f.name], plans) for f in fields)
        # str and bool fields need only a type test, done inline instead of a call
        fast_types = tuple(
            hints[f.name] if hints[f.name] in (str, bool) else _NoFastPath for f in fields
        )
        # (index, encoder) only for fields that need converting; the rest go as they are
        converters = tuple(
            (i, enc)
            for i, f in enumerate(fields)
            if (enc := _field_encoder(cls, f.name, hints[f.name], plans)) is not None
        )
        self.encode = self._make_encoder(converters)
        self.decode = self._make_decoder(decoders, fast_types, _CHECKS.get(cls))

    def _make_encoder(self, converters: tuple[tuple[int, Encoder], ...]) -> Encoder:
        cls, name, names = self.cls, self.name, self.names

        def encode(obj: Any) -> list[Any]:
            if type(obj) is not cls:
                raise EncodeError(f"expected {name}, got {type(obj).__name__}")
            d = obj.__dict__
            values = [d[n] for n in names]
            for i, enc in converters:
                values[i] = enc(values[i])
            return values

        return encode

    def _make_decoder(
        self,
        decoders: tuple[Decoder, ...],
        fast_types: tuple[type, ...],
        check: Callable[[Any], None] | None,
    ) -> Decoder:
        # closures over locals: the hot path does no attribute lookups on the plan
        cls, name, lo, hi = self.cls, self.name, self.min_arity, self.max_arity

        def decode(v: Any) -> Any:
            if type(v) is not list:
                raise DecodeError("type", f"{name}: expected array, got {_short(v)}")
            if not lo <= len(v) <= hi:
                raise DecodeError("arity", f"{name}: {len(v)} fields, expected {lo}..{hi}")
            args = [x if type(x) is t else d(x) for x, t, d in zip(v, fast_types, decoders)]
            try:
                obj = cls(*args)
            except (TypeError, ValueError) as e:  # SamplingParamsError is a ValueError
                raise DecodeError("value", f"{name}: {e}") from None
            if check is not None:
                check(obj)
            return obj

        return decode


class _NoFastPath:
    """A type no wire value has: fields marked with it always go through their decoder."""


def _plan(cls: type, plans: dict[type, _Plan]) -> _Plan:
    return plans[cls] if cls in plans else _Plan(cls, plans)


def _split_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1 or len(typing.get_args(tp)) != 2:
            raise TypeError(f"unsupported union {tp}")
        return args[0], True
    return tp, False


def _field_decoder(owner: type, name: str, tp: Any, plans: dict[type, _Plan]) -> Decoder:
    where = f"{owner.__name__}.{name}"
    inner, optional = _split_optional(tp)
    dec = _value_decoder(owner, name, where, inner, plans)
    return _optional_decoder(dec) if optional else dec


def _value_decoder(
    owner: type, name: str, where: str, tp: Any, plans: dict[type, _Plan]
) -> Decoder:
    if tp is bool or tp is str:
        return _exact_decoder(where, tp)
    if tp is int:
        signed = owner in _SELF_VALIDATING or (owner, name) in _SIGNED_INT_FIELDS
        return _int_decoder(where) if signed else _uint_decoder(where)
    if tp is float:
        return _float_decoder(where, (owner, name) in _LOGPROB_FIELDS)
    if dataclasses.is_dataclass(tp):
        return _plan(tp, plans).decode
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        if item is int:
            return _packed_int32_decoder(where)
        item, optional = _split_optional(item)
        if item is str and not optional:
            return _str_list_decoder(where)
        if item is float and not optional:
            return _float_list_decoder(where, (owner, name) in _LOGPROB_FIELDS)
        return _list_decoder(where, _value_decoder(owner, name, where, item, plans), optional)
    raise TypeError(f"{where}: no wire encoding for {tp}")


def _field_encoder(owner: type, name: str, tp: Any, plans: dict[type, _Plan]) -> Encoder | None:
    inner, optional = _split_optional(tp)
    enc: Encoder | None
    if inner is float:
        enc = float
    elif dataclasses.is_dataclass(inner):
        enc = _plan(inner, plans).encode
    elif typing.get_origin(inner) is list:
        (item,) = typing.get_args(inner)
        item, item_optional = _split_optional(item)
        if item is int:
            enc = pack_int32
        elif item is float:
            enc = _encode_floats
        elif dataclasses.is_dataclass(item):
            item_enc = _plan(item, plans).encode
            if item_optional:
                enc = lambda xs: [None if x is None else item_enc(x) for x in xs]  # noqa: E731
            else:
                enc = lambda xs: list(map(item_enc, xs))  # noqa: E731
        else:
            enc = None  # list[str]: msgpack packs it as it is
    else:
        enc = None  # str, int, bool: msgpack packs them as they are
    if enc is None or not optional:
        return enc
    inner_enc = enc
    return lambda v: None if v is None else inner_enc(v)


# -- cross-field invariants ----------------------------------------------------------------


def _same_length(where: str, a: Sequence[Any], b: Sequence[Any], a_name: str, b_name: str) -> None:
    if len(a) != len(b):
        raise DecodeError("value", f"{where}: {len(a)} {a_name} but {len(b)} {b_name}")


def _check_new_request(r: NewRequest) -> None:
    n = len(r.token_ids)
    if r.num_prompt_tokens > n or r.num_computed_tokens > n:
        raise DecodeError("value", f"NewRequest: counts exceed its {n} tokens")


def _check_step_batch(b: StepBatch) -> None:
    _same_length("StepBatch", b.scheduled_request_ids, b.num_scheduled_tokens,
                 "scheduled_request_ids", "num_scheduled_tokens")


def _check_step_result(r: StepResult) -> None:
    _same_length("StepResult", r.request_ids, r.sampled_token_ids, "request_ids",
                 "sampled_token_ids")
    if r.logprobs:
        _same_length("StepResult", r.request_ids, r.logprobs, "request_ids", "logprobs")


def _check_token_logprobs(t: TokenLogprobs) -> None:
    _same_length("TokenLogprobs", t.top_token_ids, t.top_logprobs, "top_token_ids",
                 "top_logprobs")


def _check_request_output(o: RequestOutput) -> None:
    if o.new_logprobs:
        _same_length("RequestOutput", o.new_token_ids, o.new_logprobs, "new_token_ids",
                     "new_logprobs")


_CHECKS: dict[type, Callable[[Any], None]] = {
    NewRequest: _check_new_request,
    StepBatch: _check_step_batch,
    StepResult: _check_step_result,
    TokenLogprobs: _check_token_logprobs,
    RequestOutput: _check_request_output,
}

# Build every plan now, so a bad annotation fails at import and the hot path never builds.
def _build_top_plans() -> dict[int, _Plan]:
    plans: dict[type, _Plan] = {}
    return {kind: _plan(cls, plans) for kind, cls in KINDS.items()}


_TOP_PLANS: dict[int, _Plan] = _build_top_plans()
_TOP_PLAN_OF: dict[type, tuple[int, _Plan]] = {cls: (k, _TOP_PLANS[k]) for k, cls in KINDS.items()}


# -- dropped frames ------------------------------------------------------------------------


class MalformedFrameCounter:
    """Counts dropped frames by (socket name, reason) and logs them rate-limited.

    Owned by the process that receives (one per process, exported as a Prometheus
    counter by its owner); thread-safe, as IO threads record while a metrics endpoint
    reads. A warning carries the socket, the reason, at most 16 bytes of the frame in
    hex and how many drops it stands for, never the payload.
    """

    def __init__(
        self,
        logger: logging.Logger | None = None,
        log_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger or logging.getLogger("pagoda.wire")
        self._interval = log_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._last_log: dict[tuple[str, str], float] = {}
        self._unlogged: dict[tuple[str, str], int] = {}

    def record(self, socket_name: str, reason: str, prefix: bytes, detail: str) -> None:
        key = (socket_name, reason)
        now = self._clock()
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
            last = self._last_log.get(key)
            if last is not None and now - last < self._interval:
                self._unlogged[key] = self._unlogged.get(key, 0) + 1
                return
            self._last_log[key] = now
            also = self._unlogged.pop(key, 0)
        self._logger.warning(
            "dropped malformed frame on %s (%s): %s; frame starts %s%s",
            socket_name, reason, detail[:200], prefix[:16].hex() or "(empty)",
            f"; {also} more dropped since the last warning" if also else "",
        )

    def count(self, socket_name: str | None = None, reason: str | None = None) -> int:
        """Drops so far, optionally only for one socket and/or one reason."""
        with self._lock:
            return sum(
                n for (s, r), n in self._counts.items()
                if (socket_name is None or s == socket_name) and (reason is None or r == reason)
            )

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


# -- public API ----------------------------------------------------------------------------


def encode(msg: Any) -> bytes:
    """One message -> one frame. EncodeError for a type not in KINDS or a bad id list."""
    entry = _TOP_PLAN_OF.get(type(msg))
    if entry is None:
        raise EncodeError(f"{type(msg).__name__} is not a wire message")
    kind, plan = entry
    try:
        return msgpack.packb([WIRE_VERSION, kind, plan.encode(msg)], use_bin_type=True)
    except EncodeError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise EncodeError(f"{plan.name}: {e}") from None


def decode(frame: bytes | bytearray | memoryview, expected: tuple[type, ...] | None = None) -> Any:
    """One frame -> one message, or DecodeError saying why not.

    ``expected`` lists the types this socket accepts; a valid frame of another kind is
    rejected (``unexpected_kind``) before its payload is decoded.
    """
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise DecodeError("type", f"frame is {type(frame).__name__}, not bytes")
    if len(frame) > MAX_FRAME_BYTES:
        raise DecodeError("too_large", f"frame of {len(frame)} bytes")
    try:
        envelope = msgpack.unpackb(frame, **_UNPACK_OPTIONS)
    except Exception as e:  # msgpack raises ValueError subclasses, UnicodeDecodeError, ...
        raise DecodeError("msgpack", f"not a valid msgpack frame ({type(e).__name__}: {e})"[:200]) from None
    if type(envelope) is not list or len(envelope) != 3:
        raise DecodeError("envelope", f"expected [version, kind, payload], got {_short(envelope)}")
    version, kind, payload = envelope
    if type(version) is not int or version != WIRE_VERSION:
        raise DecodeError("version", f"wire version {_short(version)}, expected {WIRE_VERSION}")
    plan = _TOP_PLANS.get(kind) if type(kind) is int else None
    if plan is None:
        raise DecodeError("kind", f"unknown message kind {_short(kind)}")
    if expected is not None and plan.cls not in expected:
        raise DecodeError("unexpected_kind", f"{plan.name} is not accepted here")
    return plan.decode(payload)


def safe_decode(
    frames: Sequence[Any],
    socket_name: str,
    expected: tuple[type, ...] | None,
    counter: MalformedFrameCounter,
    *,
    num_frames: int = 1,
) -> Any | None:
    """Decode the last of a multipart message's frames; never raises.

    ``num_frames`` is how many frames the socket's messages have (2 on a ROUTER: the
    peer identity, then the payload). Anything malformed is counted in ``counter`` under
    ``(socket_name, reason)``, logged rate-limited with a short hex prefix, and dropped
    (None is returned).
    """
    frame: Any = b""
    try:
        if len(frames) != num_frames:
            frame = frames[-1] if len(frames) else b""
            counter.record(socket_name, "frame_count", _prefix(frame),
                           f"{len(frames)} frames, expected {num_frames}")
            return None
        frame = frames[-1]
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            frame = memoryview(frame)  # zmq.Frame (copy=False) exposes the buffer protocol
        return decode(frame, expected)
    except DecodeError as e:
        counter.record(socket_name, e.reason, _prefix(frame), str(e))
    except Exception as e:  # a bug in the codec must not kill a receive loop either
        counter.record(socket_name, "internal", _prefix(frame), f"{type(e).__name__}: {e}"[:200])
    return None


def _prefix(frame: Any) -> bytes:
    try:
        return bytes(memoryview(frame)[:16])
    except Exception:
        return b""
