"""KV cache events in vLLM's format, for gateways that route by prefix-cache contents.

The block manager records an event whenever its prefix cache changes (a full block is
registered, a registered block is evicted, the whole cache is forgotten); the loop takes
them after every step and ``KVEventPublisher`` sends them as one batch, as vLLM's
``ZmqEventPublisher`` does, so a subscriber written for vLLM (llm-d's KV-cache indexer,
Dynamo's KV router, the Gateway API Inference Extension's prefix scorer) reads ours:

- three frames per batch: ``[topic, seq, payload]``; ``topic`` is the configured topic
  (vLLM's default ``""``), ``seq`` an 8-byte big-endian counter from 0 that also counts
  batches dropped here, so a gap tells the subscriber it missed one;
- ``payload`` is msgpack of ``KVEventBatch``, an array ``[ts, events, data_parallel_rank]``
  (wall-clock seconds; rank 0: one engine);
- each event is tagged with its class name. ``map`` encoding (vLLM since PR #42892,
  v0.24): a map with the tag under ``"type"`` and the fields by name, defaults left out.
  ``array`` encoding (vLLM up to v0.23, and subscribers written for it): a positional
  array ``[tag, field, field, ...]`` in declaration order, every field present.

Block hashes are ``services.scheduler.block_manager.hash_block``'s unsigned 64-bit ints,
stable across processes and restarts (vLLM's ``ExternalBlockHash`` as an int). Sockets:
an XPUB with ``XPUB_NODROP`` (``shared.ipc.make_socket``), sent NOBLOCK, so the step never
waits: a batch that some subscriber has no room for is dropped for all and counted.
It binds a wildcard, ``ipc://`` or ``inproc://`` endpoint and connects to a concrete TCP
host (a subscriber that binds, as llm-d's indexer does), as vLLM decides.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from shared.config import KV_EVENTS_ENCODINGS
from shared.curve import CurveKeys
from shared.ipc import is_wildcard, make_socket

log = logging.getLogger("pagoda.scheduler.kv_events")

MEDIUM_GPU = "GPU"  # vLLM's name for the engine's own KV pool (ours may live on the CPU)
FULL_ATTENTION = "full_attention"  # the one KV cache group every pagoda model has
ENCODINGS = KV_EVENTS_ENCODINGS  # "map", "array"


class KVCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base of the three events; the tag is the class name, as in vLLM. Fields and
    defaults are vLLM's: a field without a default is always on the wire."""


class BlockStored(KVCacheEvent):
    """Consecutive blocks of one sequence entered the prefix cache."""

    block_hashes: list[int]
    parent_block_hash: int | None  # the block before the first; None: a sequence's first
    token_ids: list[int]  # every token of the blocks, in order
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks were evicted (their slots handed out for other tokens)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was forgotten as a whole (``reset_prefix_cache``)."""


def stored(block_hashes: list[int], parent: int | None, token_ids: list[int],
           block_size: int) -> BlockStored:
    return BlockStored(block_hashes, parent, token_ids, block_size, lora_id=None,
                       medium=MEDIUM_GPU, lora_name=None, group_idx=0,
                       kv_cache_spec_kind=FULL_ATTENTION)


def removed(block_hashes: list[int]) -> BlockRemoved:
    return BlockRemoved(block_hashes, medium=MEDIUM_GPU, group_idx=0)


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float  # time.time() when the batch was sent
    events: list[Any]  # KVCacheEvent structs (map encoding) or positional lists (array)
    data_parallel_rank: int | None = None  # always sent: 0, one engine


def as_array(event: KVCacheEvent) -> list[Any]:
    """vLLM's positional (``array_like``) form of one tagged event."""
    return [type(event).__name__, *msgspec.structs.astuple(event)]


def binds_endpoint(endpoint: str) -> bool:
    """Whether the publisher binds ``endpoint`` (a wildcard, ipc:// or inproc:// one) or
    connects to it (``tcp://host:port``: a subscriber that binds, as vLLM does it)."""
    return is_wildcard(endpoint) or not endpoint.startswith("tcp://")


class KVEventPublisher:
    """One PUB-style socket; ``publish`` once per step. Counts what it could not send."""

    def __init__(self, sock: zmq.Socket[Any], topic: str = "", encoding: str = "map",
                 clock: Callable[[], float] = time.time) -> None:
        if encoding not in ENCODINGS:
            raise ValueError(f"kv events encoding: expected one of {ENCODINGS}, got {encoding!r}")
        self.sock = sock
        self.topic = topic.encode()
        self.encoding = encoding
        self.clock = clock
        self._encoder = msgspec.msgpack.Encoder()
        self.seq = 0  # the next batch's sequence number
        self.published = 0  # batches handed to ZMQ
        self.dropped = 0  # batches a full subscriber pipe (or an error) kept from going out

    @classmethod
    def open(cls, ctx: zmq.Context[Any], endpoint: str, *, topic: str = "", encoding: str = "map",
             hwm: int = 10_000, allow_wildcard: bool = False,
             curve: CurveKeys | None = None) -> KVEventPublisher:
        bind = binds_endpoint(endpoint)
        sock = make_socket(ctx, zmq.XPUB, endpoint, bind=bind, sndhwm=hwm, rcvhwm=hwm,
                           allow_wildcard=allow_wildcard, curve=curve)
        try:
            return cls(sock, topic, encoding)
        except BaseException:
            sock.close(linger=0)
            raise

    def encode(self, events: list[KVCacheEvent]) -> bytes:
        body = events if self.encoding == "map" else [as_array(e) for e in events]
        return self._encoder.encode(KVEventBatch(self.clock(), body, data_parallel_rank=0))

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Send one batch (nothing when ``events`` is empty). Never blocks, never raises."""
        self._drain_subscriptions()
        if not events:
            return
        seq, self.seq = self.seq, self.seq + 1
        frames = [self.topic, seq.to_bytes(8, "big"), self.encode(events)]
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # EAGAIN: a subscriber's pipe is full
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("KV events: %d batches dropped so far (%s): a subscriber is slow",
                            self.dropped, e.strerror)
        else:
            self.published += 1

    def _drain_subscriptions(self) -> None:
        # XPUB_VERBOSE hands us every (un)subscription; unread, they would pile up
        try:
            while self.sock.poll(0, zmq.POLLIN):
                self.sock.recv(zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        self.sock.close()
