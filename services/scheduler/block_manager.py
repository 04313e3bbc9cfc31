"""The paged KV-cache block manager: which physical blocks each sequence holds.

The scheduler asks it for blocks before every step; the workers only ever see the
resulting block ids. It owns no tensors.

Blocks (``block_size`` token slots each) live in one pool of ``num_blocks``. A block
is *held* while its ``ref_count`` > 0 (a sequence's block table names it; prompt
blocks shared by the children of an ``n > 1`` request, or by prefix-cache hits, are
held once per holder). A block with ``ref_count == 0`` sits in the free queue.

Prefix caching: once a block is full and its K/V are computed, it gets a hash chained
over ``(parent block's hash, its token ids)`` (``hash_block``: 64 bits of SHA-256, the
same in every process) and enters ``cached`` (hash -> block). When it is freed it keeps
its hash and contents, so a later sequence with the same prefix takes it back (a *hit*,
confirmed by comparing token ids, not the hash alone) until the block is handed out
again for new tokens (*evicted*).

KV events (``record_events``): every change of ``cached`` is recorded in vLLM's event
format (``services/scheduler/kv_events.py``) for ``take_events``: a ``BlockStored`` per
run of consecutive blocks a sequence registers, a ``BlockRemoved`` when a registered
block is evicted, ``AllBlocksCleared`` on ``reset_prefix_cache``. Replaying them gives
exactly the keys of ``cached``.

The free queue is also the LRU eviction order: blocks are taken from its front;
freed blocks that carry a hash go to its back, a sequence's blocks tail-first (so
chain tails evict before their parents); freed blocks without a hash go to its front
(reused first, nothing to lose).

Invariants (``check_invariants``):
- every block is either in the free queue (ref_count 0) or held (ref_count > 0);
- each block's ref_count equals the number of sequence block tables naming it;
- ``cached`` maps a hash only to a block carrying that hash;
- free + held == num_blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from functools import cache

from services.scheduler.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    KVCacheEvent,
    removed,
    stored,
)


class BlockAccountingError(AssertionError):
    """The block accounting invariant is broken (a bug, never user input)."""


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_count: int = 0
    # set once the block is full and computed; kept after free until evicted
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(slots=True)
class _SeqBlocks:
    block_ids: list[int] = field(default_factory=list)
    num_hashed: int = 0  # leading blocks whose hash is known
    last_hash: int | None = None  # hash of block num_hashed - 1


# the parent of a sequence's first block, in the hash input (never published: vLLM's
# events give such a block's parent as None)
ROOT_HASH = int.from_bytes(hashlib.sha256(b"pagoda kv block hash v1").digest()[-8:], "big")


@cache
def _packer(num_tokens: int) -> struct.Struct:
    return struct.Struct(f"<Q{num_tokens}I")


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The block's hash: an unsigned 64-bit int, the last 8 bytes (big-endian) of
    SHA-256 over the parent's hash (``ROOT_HASH`` for a first block) as a little-endian
    uint64, followed by each token id as a little-endian uint32.

    Stable across processes and restarts (Python's ``hash`` is salted per process), so
    it can be published (KV events) and compared between engines. ~0.7 us a block.
    """
    data = _packer(len(token_ids)).pack(ROOT_HASH if parent_hash is None else parent_hash,
                                        *token_ids)
    return int.from_bytes(hashlib.sha256(data).digest()[-8:], "big")


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 record_events: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> None; front = next to hand out (LRU order among cached blocks)
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block_id
        self.seqs: dict[Hashable, _SeqBlocks] = {}
        # changes of `cached` since the last take_events (None: not recorded)
        self._events: list[KVCacheEvent] | None = [] if record_events else None

    # -- queries ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (never-used, freed, or evictable cached)."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the pool held by sequences (evictable cached blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_ids(self, seq_id: Hashable) -> list[int]:
        return self.seqs[seq_id].block_ids

    def holds(self, seq_id: Hashable) -> bool:
        return seq_id in self.seqs

    def find_cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """Cached blocks holding the longest prefix of token_ids, in order.

        At least one token is always left to compute (its logits are needed), so a
        prompt of k full blocks hits at most k - 1 of them.
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        hits: list[int] = []
        parent: int | None = None
        for start in range(0, len(token_ids) - 1 - bs + 1, bs):
            tokens = tuple(token_ids[start : start + bs])
            h = hash_block(parent, tokens)
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    # -- allocation ------------------------------------------------------------------
    def can_allocate(self, shared_block_ids: Sequence[int], num_tokens: int) -> bool:
        """Whether a new sequence sharing these blocks can hold num_tokens tokens."""
        # a shared block with ref_count 0 leaves the free queue when taken
        reclaimed = sum(1 for b in shared_block_ids if self.blocks[b].ref_count == 0)
        fresh = self.blocks_needed(num_tokens) - len(shared_block_ids)
        return fresh <= len(self.free_queue) - reclaimed

    def allocate(self, seq_id: Hashable, shared_block_ids: Sequence[int], num_tokens: int) -> list[int] | None:
        """Give a new sequence the shared blocks plus fresh ones up to num_tokens tokens.

        Returns its whole block table, or None (nothing changed) when the pool is short.
        """
        if seq_id in self.seqs:
            raise BlockAccountingError(f"sequence {seq_id!r} already holds blocks")
        if not self.can_allocate(shared_block_ids, num_tokens):
            return None
        for block_id in shared_block_ids:
            self._take(block_id)
        seq = _SeqBlocks(block_ids=list(shared_block_ids))
        self.seqs[seq_id] = seq
        seq.block_ids.extend(self._pop_free() for _ in range(self.blocks_needed(num_tokens) - len(seq.block_ids)))
        return seq.block_ids

    def append_slots(self, seq_id: Hashable, num_tokens: int) -> list[int] | None:
        """Grow a sequence's table to hold num_tokens tokens.

        Returns the newly added block ids (often none), or None when the pool is short.
        """
        seq = self.seqs[seq_id]
        missing = self.blocks_needed(num_tokens) - len(seq.block_ids)
        if missing <= 0:
            return []
        if missing > len(self.free_queue):
            return None
        new = [self._pop_free() for _ in range(missing)]
        seq.block_ids.extend(new)
        return new

    def cache_full_blocks(self, seq_id: Hashable, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Hash the sequence's blocks that are full and computed; register new ones."""
        if not self.enable_prefix_caching:
            return
        seq = self.seqs[seq_id]
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(seq.block_ids))
        parent = seq.last_hash
        run: list[KVBlock] = []  # blocks registered just now, consecutive: one event
        run_parent: int | None = None
        for i in range(seq.num_hashed, num_full):
            block = self.blocks[seq.block_ids[i]]
            if block.block_hash is not None:  # shared (a hit, a sibling's): hashed already
                h = block.block_hash
            else:
                tokens = tuple(token_ids[i * bs : (i + 1) * bs])
                h = hash_block(parent, tokens)
                block.block_hash, block.token_ids = h, tokens
                # a twin computed at the same time may already be cached: keep the first
                if (self.cached.setdefault(h, block.block_id) == block.block_id
                        and self._events is not None):
                    if not run:
                        run_parent = parent
                    run.append(block)
                    parent = h
                    continue
            if run:
                self._record_stored(run, run_parent)
                run = []
            parent = h
        if run:
            self._record_stored(run, run_parent)
        if num_full > seq.num_hashed:
            seq.num_hashed, seq.last_hash = num_full, parent

    def free(self, seq_id: Hashable) -> None:
        """Release every block of the sequence, tail first."""
        seq = self.seqs.pop(seq_id, None)
        if seq is None:
            raise BlockAccountingError(f"sequence {seq_id!r} holds no blocks (double free?)")
        for block_id in reversed(seq.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None
                if block.block_hash is None:
                    self.free_queue.move_to_end(block_id, last=False)
            elif block.ref_count < 0:
                raise BlockAccountingError(f"block {block_id} freed below zero")

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (held blocks keep their contents)."""
        for block in self.blocks:
            block.block_hash, block.token_ids = None, None
        self.cached.clear()
        for seq in self.seqs.values():
            seq.num_hashed, seq.last_hash = 0, None
        if self._events is not None:
            self._events.append(AllBlocksCleared())

    def take_events(self) -> list[KVCacheEvent]:
        """The KV events recorded since the last call, oldest first (empty when off)."""
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    # -- internals -------------------------------------------------------------------
    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: its old contents are about to be overwritten
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
                if self._events is not None:
                    self._record_removed(block.block_hash)
            block.block_hash, block.token_ids = None, None
        block.ref_count = 1
        return block_id

    def _record_stored(self, run: list[KVBlock], parent: int | None) -> None:
        assert self._events is not None
        tokens: list[int] = []
        for block in run:
            tokens += block.token_ids or ()
        self._events.append(stored([b.block_hash for b in run if b.block_hash is not None],
                                   parent, tokens, self.block_size))

    def _record_removed(self, block_hash: int) -> None:
        assert self._events is not None
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):  # evictions in a row: one event, as they come
            last.block_hashes.append(block_hash)
        else:
            self._events.append(removed([block_hash]))

    # -- invariants ------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise BlockAccountingError if the accounting is inconsistent."""
        holders = [0] * self.num_blocks
        for seq_id, seq in self.seqs.items():
            if len(set(seq.block_ids)) != len(seq.block_ids):
                raise BlockAccountingError(f"sequence {seq_id!r} names a block twice")
            for b in seq.block_ids:
                holders[b] += 1
        for block in self.blocks:
            in_free = block.block_id in self.free_queue
            if block.ref_count != holders[block.block_id]:
                raise BlockAccountingError(
                    f"block {block.block_id}: ref_count {block.ref_count}, {holders[block.block_id]} holders"
                )
            if in_free != (block.ref_count == 0):
                raise BlockAccountingError(
                    f"block {block.block_id}: ref_count {block.ref_count} but in_free_queue={in_free}"
                )
        held = sum(1 for n in holders if n > 0)
        if held + len(self.free_queue) != self.num_blocks:
            raise BlockAccountingError(
                f"free {len(self.free_queue)} + held {held} != total {self.num_blocks}"
            )
        for h, block_id in self.cached.items():
            if self.blocks[block_id].block_hash != h:
                raise BlockAccountingError(f"cached hash maps to block {block_id} with another hash")
