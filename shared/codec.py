"""The ZMQ wire codec: a message of ``shared/protocol.py`` <-> one msgpack frame.

Frame: ``[WIRE_VERSION, [tag, *fields]]``; the inner array is the message's tagged
``array_like`` struct (fields in declaration order, nested structs as untagged arrays,
ids as plain msgpack ints). Every process sends ``encode(msg)`` and receives with
``safe_decode(frames, link, counter)``, which never raises: a malformed frame is
dropped, counted by (socket, reason) and logged rate-limited.

Decoding is the schema check: the socket's ``Link`` decoder, typed by the union of
what it accepts, checks in one pass the version, the tag, each field's type and range
and runs the structs' ``__post_init__``. Nothing decodes as ``Any``, so ext types,
timestamps, maps and deep nesting fail at the first value of the wrong type. Schema
evolution is append-only: a frame missing trailing fields (an older peer) decodes with
their defaults; one with extra fields is refused (``arity``); a breaking change bumps
WIRE_VERSION.

Drop reasons: ``msgpack`` (undecodable: truncated, trailing bytes, bad UTF-8),
``too_large``, ``envelope`` (not ``[version, [...]]``), ``version``, ``kind`` (unknown
tag), ``unexpected_kind`` (another link's message), ``arity``, ``type``, ``range`` (an
int or length out of range, a float not finite), ``value`` (a ``__post_init__`` check),
``frame_count`` (multipart shape), ``internal`` (a bug in a check).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from shared.protocol import ANY_MESSAGE, MESSAGE_TYPES, WIRE_VERSION, Link

__all__ = [
    "MAX_FRAME_BYTES", "WIRE_VERSION", "DecodeError", "EncodeError", "MalformedFrameCounter",
    "decode", "encode", "safe_decode",
]

# Hard limit on one frame; sockets set ZMQ_MAXMSGSIZE to MAX_FRAME_BYTES too (shared/ipc.py).
MAX_FRAME_BYTES = 256 * 1024 * 1024

_MESSAGE_TYPES = frozenset(MESSAGE_TYPES)
_TAGS = frozenset(cls.__struct_config__.tag for cls in MESSAGE_TYPES)
_ENCODER = msgspec.msgpack.Encoder()
# "Expected `int` >= 0 - at `$[1][3]`": the message, then where in the frame
_AT = re.compile(r"^(.*?)(?: - at `\$(.*)`)?$", re.DOTALL)
_RANGE = re.compile(r"^Expected `\w+` (of length )?[<>]=? |must be finite")
_TAG = re.compile(r"^Invalid value (\d+)$")


class DecodeError(ValueError):
    """A frame that is not a valid message; ``reason`` is a short label for counters."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EncodeError(ValueError):
    """A message that cannot go on the wire (a bug in the sender)."""


def encode(msg: Any, *, validate: bool = False) -> bytes:
    """One message -> one frame. EncodeError for a non-message or an unencodable field.

    Field values are checked by the receiver's typed decode, not here. ``validate=True``
    runs that decode now and raises EncodeError for a frame a peer would drop (a negative
    or oversized id, a str where an int goes): for messages built from user input.
    """
    if type(msg) not in _MESSAGE_TYPES:
        raise EncodeError(f"{type(msg).__name__} is not a wire message")
    try:
        frame = _ENCODER.encode((WIRE_VERSION, msg))
    except (TypeError, ValueError, OverflowError) as e:
        raise EncodeError(f"{type(msg).__name__}: {e}") from None
    if validate:
        try:
            decode(frame)
        except DecodeError as e:
            raise EncodeError(f"{type(msg).__name__} would be refused ({e.reason}): {e}") from None
    return frame


def decode(frame: Any, link: Link = ANY_MESSAGE) -> Any:
    """One frame -> one message of ``link``'s union, or DecodeError saying why not."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise DecodeError("type", f"frame is {type(frame).__name__}, not bytes")
    if len(frame) > MAX_FRAME_BYTES:  # ZMQ enforces it too; this guards in-process callers
        raise DecodeError("too_large", f"frame of {len(frame)} bytes")
    try:
        return link.decoder.decode(frame)[1]
    except msgspec.ValidationError as e:
        raise DecodeError(_reason(str(e)), f"{link.name}: {e}"[:300]) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise DecodeError("msgpack", f"not a valid msgpack frame: {e}"[:200]) from None


def _reason(text: str) -> str:
    """A short label for a msgspec ValidationError message (which names no payload)."""
    match = _AT.match(text)
    message, path = (match.group(1), match.group(2) or "") if match else (text, "")
    if path == "":
        reason = "envelope"
    elif path == "[0]":
        reason = "version"
    elif path == "[1][0]":  # the tag
        known = _TAG.match(message)
        reason = "unexpected_kind" if known and int(known.group(1)) in _TAGS else "kind"
    elif path == "[1]" and message.startswith("Expected `array`, got"):
        reason = "envelope"
    elif message.startswith("Expected `array` of at"):
        reason = "arity"
    elif _RANGE.search(message):
        reason = "range"
    elif message.startswith("Expected `"):
        reason = "type"
    else:  # a __post_init__ check: lengths, counts, sampling parameters
        reason = "value"
    return reason


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


def safe_decode(
    frames: Sequence[Any],
    link: Link,
    counter: MalformedFrameCounter,
    *,
    num_frames: int = 1,
    socket_name: str | None = None,
) -> Any | None:
    """Decode the last of a multipart message's frames as one of ``link``'s messages;
    never raises.

    ``num_frames`` is how many frames the socket's messages have (2 on a ROUTER: the
    peer identity, then the payload). Frames may be bytes or ``zmq.Frame`` (copy=False;
    decoded from its buffer). Anything malformed is counted in ``counter`` under
    ``(socket_name or link.name, reason)``, logged rate-limited with a short hex prefix,
    and dropped (None is returned).
    """
    socket_name = socket_name or link.name
    frame: Any = b""
    try:
        if len(frames) != num_frames:
            frame = frames[-1] if len(frames) else b""
            counter.record(socket_name, "frame_count", _prefix(frame),
                           f"{len(frames)} frames, expected {num_frames}")
            return None
        frame = frames[-1]
        if not isinstance(frame, (bytes, bytearray, memoryview)):
            try:
                frame = memoryview(frame)  # zmq.Frame (copy=False) exposes the buffer protocol
            except TypeError:
                pass  # decode() refuses it
        return decode(frame, link)
    except DecodeError as e:
        counter.record(socket_name, e.reason, _prefix(frame), str(e))
    except Exception as e:  # noqa: BLE001 (a bug in a check must not kill a receive loop)
        counter.record(socket_name, "internal", _prefix(frame), f"{type(e).__name__}: {e}"[:200])
    return None


def _prefix(frame: Any) -> bytes:
    try:
        return bytes(memoryview(frame)[:16])
    except Exception:  # noqa: BLE001 (only for the log line)
        return b""
