"""KV cache events in vLLM's format: a real scheduler and block manager, driven by a
fabricated worker through prefix-cache hits, evictions, preemptions and a cache reset,
publish after every step as the loop does; a SUB socket receives the frames, decodes
them the way vLLM's subscribers do, replays them into a model of the cache and finds
exactly the block manager's cached blocks. Also: the block hash is stable across
processes, a slow subscriber costs counted drops (never a blocked step), the setting
and the socket's lifecycle."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from services.scheduler.block_manager import ROOT_HASH, BlockManager, hash_block
from services.scheduler.handshake import SchedulerSockets
from services.scheduler.kv_events import KVEventPublisher
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from shared.config import ConfigError, Endpoints, load_config
from shared.sampling_params import SamplingParams
from support.fake_worker import FakeWorker

REPO = Path(__file__).resolve().parents[2]
TOPIC = "kv-events"
BS = 4


# -- the subscriber's side, declared as vLLM declares it (vllm/distributed/kv_events.py;
# examples/online_serving/kv_events_subscriber.py): msgspec structs, same field order ----


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# vLLM >= 0.24 (PR #42892): each event a map tagged by "type"
class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# vLLM <= 0.23 and the subscribers written for it: each event a positional array,
# [tag, fields...]; this one declares the fields up to `medium` (later ones are ignored)
class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ArrayBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ArrayAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(EventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


DECODERS: dict[str, msgspec.msgpack.Decoder[Any]] = {
    "map": msgspec.msgpack.Decoder(KVEventBatch), "array": msgspec.msgpack.Decoder(ArrayKVEventBatch)}


def receive_all(sub: zmq.Socket[Any], count: int, encoding: str) -> list[Any]:
    """``count`` batches, checking the framing: [topic, 8-byte big-endian seq, payload]."""
    batches = []
    for expected_seq in range(count):
        assert sub.poll(5000, zmq.POLLIN), f"batch {expected_seq} of {count} never came"
        topic, seq, payload = sub.recv_multipart()
        assert topic == TOPIC.encode() and len(seq) == 8
        assert int.from_bytes(seq, "big") == expected_seq
        batch = DECODERS[encoding].decode(payload)
        assert batch.data_parallel_rank == 0 and abs(batch.ts - time.time()) < 60
        batches.append(batch)
    return batches


def replay(batches: list[Any], model: dict[int, tuple[int, ...]]) -> tuple[int, int, int]:
    """Apply the events to ``model`` (hash -> the block's tokens), checking each stored
    hash against its content; returns how many (stored, removed, cleared) events came."""
    counts = [0, 0, 0]
    for batch in batches:
        for event in batch.events:
            name = type(event).__name__.removeprefix("Array")
            if name == "BlockStored":
                assert event.block_size == BS and event.medium == "GPU" and event.lora_id is None
                assert len(event.token_ids) == BS * len(event.block_hashes)
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    tokens = tuple(event.token_ids[i * BS:(i + 1) * BS])
                    assert hash_block(parent, tokens) == h, "a subscriber can recompute the chain"
                    assert h not in model, "stored twice without a removal"
                    model[h] = tokens
                    parent = h
                counts[0] += 1
            elif name == "BlockRemoved":
                for h in event.block_hashes:
                    assert model.pop(h, None) is not None, "removed a block never stored"
                counts[1] += 1
            else:
                model.clear()
                counts[2] += 1
    return counts[0], counts[1], counts[2]


def cached_state(bm: BlockManager) -> dict[int, tuple[int, ...]]:
    state = {}
    for h, block_id in bm.cached.items():
        tokens = bm.blocks[block_id].token_ids
        assert tokens is not None
        state[h] = tokens
    return state


def drive(s: Scheduler, w: FakeWorker, pub: KVEventPublisher) -> None:
    """Steps until idle, publishing after each as services/scheduler/loop.py does."""
    for _ in range(5000):
        if not s.has_unfinished_requests():
            return
        batch = s.schedule()
        s.update(batch, w.execute(batch))
        s.check_invariants()
        pub.publish(s.block_manager.take_events())
    raise AssertionError("the scheduler did not drain")


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture
def ctx() -> Any:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_replayed_events_equal_the_cached_blocks(tmp_path: Path, ctx: Any, encoding: str) -> None:
    endpoint = f"ipc://{tmp_path}/kv.sock"
    pub = KVEventPublisher.open(ctx, endpoint, topic=TOPIC, encoding=encoding)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(endpoint)
    assert pub.sock.poll(5000, zmq.POLLIN), "the subscription never reached the publisher"

    # 10 blocks of 4: two 18-token sequences with 12 output tokens each cannot both fit
    s = Scheduler(SchedulerConfig(num_blocks=10, block_size=BS, vocab_size=1000,
                                  max_num_batched_tokens=64, strict_invariants=True,
                                  enable_kv_events=True))
    w = FakeWorker(BS, 1000)
    shared = [10 + i for i in range(12)]
    s.add_request("first", [*shared, 1, 2], params(3))
    drive(s, w, pub)
    s.add_request("hit", [*shared, 3, 4], params(3))  # the 3 blocks of the prefix hit
    drive(s, w, pub)
    assert s.stats().prefix_cache_hits == 3 * BS
    s.add_request("a", [100 + i for i in range(18)], params(12))
    s.add_request("b", [200 + i for i in range(18)], params(12))
    drive(s, w, pub)  # evicts the shared prefix's blocks, preempts "b"
    assert s.stats().num_preemptions >= 1
    s.block_manager.reset_prefix_cache()
    pub.publish(s.block_manager.take_events())
    s.add_request("after", [*shared, 5, 6], params(5))  # a miss now; caches again
    drive(s, w, pub)
    assert pub.dropped == 0

    batches = receive_all(sub, pub.published, encoding)
    model: dict[int, tuple[int, ...]] = {}
    stored, removed, cleared = replay(batches, model)
    assert stored and removed and cleared == 1
    assert model == cached_state(s.block_manager) != {}
    sub.close(linger=0)
    pub.close()


def test_map_events_carry_vllm_field_names(ctx: Any) -> None:
    pub = KVEventPublisher(ctx.socket(zmq.XPUB), encoding="map")
    bm = BlockManager(8, BS, record_events=True)
    bm.allocate("s", [], 8)
    bm.cache_full_blocks("s", list(range(8)), 8)
    raw = msgspec.msgpack.decode(pub.encode(bm.take_events()))
    ts, events, rank = raw
    assert isinstance(ts, float) and rank == 0 and len(events) == 1
    assert events[0] == {
        "type": "BlockStored", "block_hashes": [hash_block(None, (0, 1, 2, 3)),
                                                hash_block(hash_block(None, (0, 1, 2, 3)),
                                                           (4, 5, 6, 7))],
        "parent_block_hash": None, "token_ids": list(range(8)), "block_size": BS,
        "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
        "kv_cache_spec_kind": "full_attention"}
    pub.close()


def test_the_hash_is_sha256_of_its_inputs_and_the_same_in_every_process() -> None:
    tokens = (1, 2, 3, 4)
    want = int.from_bytes(hashlib.sha256(struct.pack("<Q4I", ROOT_HASH, *tokens)).digest()[-8:],
                          "big")
    assert hash_block(None, tokens) == want < 2**64
    chain = [hash_block(None, tokens)]
    chain.append(hash_block(chain[0], (5, 6, 7, 8)))
    code = ("from services.scheduler.block_manager import hash_block as h; "
            "a = h(None, (1, 2, 3, 4)); print(a, h(a, (5, 6, 7, 8)))")
    for seed in ("1", "2"):  # str/bytes hashing is salted per process by PYTHONHASHSEED
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                             text=True, check=True, env={**os.environ, "PYTHONHASHSEED": seed})
        assert [int(x) for x in out.stdout.split()] == chain


def test_a_slow_subscriber_costs_counted_drops_not_a_blocked_step(ctx: Any) -> None:
    pub = KVEventPublisher.open(ctx, "inproc://kv-slow", topic=TOPIC, hwm=2)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.RCVHWM, 2)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect("inproc://kv-slow")
    assert pub.sock.poll(5000, zmq.POLLIN)
    bm = BlockManager(64, BS, record_events=True)
    start = time.monotonic()
    for i in range(200):  # nobody reads
        bm.allocate(i, [], BS)
        bm.cache_full_blocks(i, [i, i, i, i], BS)
        bm.free(i)
        pub.publish(bm.take_events())
    assert time.monotonic() - start < 5
    assert pub.dropped > 0 and pub.published + pub.dropped == pub.seq == 200
    seqs = []
    while sub.poll(100, zmq.POLLIN):
        seqs.append(int.from_bytes(sub.recv_multipart()[1], "big"))
    assert seqs == sorted(seqs) and len(seqs) == pub.published < 200  # the gap shows
    sub.close(linger=0)
    pub.close()


def test_events_are_off_by_default() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=16, block_size=BS))
    w = FakeWorker(BS, 1000)
    s.add_request("r", list(range(10, 30)), params(4))
    while s.has_unfinished_requests():
        batch = s.schedule()
        s.update(batch, w.execute(batch))
    assert s.block_manager.cached and s.block_manager.take_events() == []


def test_the_setting_and_the_socket_lifecycle(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        load_config({"kv_events_endpoint": "http://x"}, {})
    with pytest.raises(ConfigError, match="KV_EVENTS_ENCODING"):
        load_config({}, {"PAGODA_KV_EVENTS_ENCODING": "json"})
    assert load_config({}, {}).process.kv_events_endpoint is None  # off by default
    path = tmp_path / "kv.sock"
    config = load_config({"kv_events_endpoint": f"ipc://{path}"},
                         {"PAGODA_KV_EVENTS_TOPIC": TOPIC},
                         default_endpoints=Endpoints.local(tmp_path))
    sockets = SchedulerSockets.bind(config)
    try:
        assert sockets.kv_events is not None and sockets.kv_events.topic == TOPIC.encode()
        assert path.exists()
    finally:
        sockets.close()
    assert not path.exists()  # the binder removes its ipc file
    sockets = SchedulerSockets.bind(load_config({}, {}, default_endpoints=Endpoints.local(tmp_path)))
    assert sockets.kv_events is None
    sockets.close()
