"""BlockManager: exact prefix-cache and eviction behaviour, then a hypothesis state
machine running thousands of random allocate/append/fork/cache/free/hit/evict/preempt
operations against a plain model of who holds which tokens, checking every invariant
after every operation."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.scheduler.block_manager import BlockAccountingError, BlockManager

BS = 4


def test_hit_reuses_freed_blocks_and_is_confirmed_by_tokens() -> None:
    bm = BlockManager(8, BS)
    tokens = list(range(13))  # 3 full blocks + 1 token
    blocks = bm.allocate("a", [], 13)
    bm.cache_full_blocks("a", tokens, 13)
    bm.free("a")
    assert bm.find_cached_prefix(tokens) == blocks[:3]
    assert bm.find_cached_prefix(tokens[:12]) == blocks[:2], "one token is always left to compute"
    assert bm.find_cached_prefix([0, 1, 2, 99] + tokens[4:]) == []
    # a hash collision must not count as a hit: corrupt the stored tokens of block 0
    bm.blocks[blocks[0]].token_ids = (9, 9, 9, 9)
    assert bm.find_cached_prefix(tokens) == []
    bm.check_invariants()


def test_lru_eviction_order_tails_first_and_uncached_first() -> None:
    bm = BlockManager(6, BS)
    a = bm.allocate("a", [], 12)  # 3 blocks, all full
    bm.cache_full_blocks("a", list(range(12)), 12)
    b = bm.allocate("b", [], 4)  # never hashed
    bm.free("a")
    bm.free("b")
    # front of the free queue: uncached (b, and the two never-used), then a's tail first
    order = list(bm.free_queue)
    assert order[0] == b[0]
    assert order[-3:] == [a[2], a[1], a[0]]
    # taking 4 blocks evicts a's tail only
    bm.allocate("c", [], 16)
    assert bm.find_cached_prefix(list(range(12)) + [0]) == a[:2]
    bm.check_invariants()


def test_shared_blocks_are_refcounted_and_double_free_is_caught() -> None:
    bm = BlockManager(8, BS)
    a = bm.allocate("a", [], 9)
    bm.allocate("b", a[:2], 9)
    assert [bm.blocks[x].ref_count for x in a] == [2, 2, 1]
    bm.free("a")
    assert bm.num_free_blocks == 8 - 3
    bm.free("b")
    with pytest.raises(BlockAccountingError):
        bm.free("b")
    bm.check_invariants()
    assert bm.usage == 0.0


def test_allocate_is_all_or_nothing() -> None:
    bm = BlockManager(4, BS)
    bm.allocate("a", [], 8)
    assert bm.allocate("b", [], 12) is None
    assert not bm.holds("b") and bm.num_free_blocks == 2
    assert bm.append_slots("a", 20) is None and len(bm.block_ids("a")) == 2
    bm.check_invariants()


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences are lists of tokens from a tiny alphabet, so prefixes repeat often."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(12, BS)
        self.tokens: dict[str, list[int]] = {}  # seq -> tokens it holds slots for
        self.computed: dict[str, int] = {}
        self.next_id = 0

    def _check_prefix_contents(self, seq: str) -> None:
        # every hashed block of a sequence must hold exactly that sequence's tokens
        for i, block_id in enumerate(self.bm.block_ids(seq)):
            block = self.bm.blocks[block_id]
            if block.token_ids is not None:
                assert list(block.token_ids) == self.tokens[seq][i * BS : (i + 1) * BS]

    @rule(length=st.integers(1, 20), alphabet=st.integers(1, 3), use_cache=st.booleans())
    def allocate(self, length: int, alphabet: int, use_cache: bool) -> None:
        tokens = [i % alphabet for i in range(length)]
        hits = self.bm.find_cached_prefix(tokens) if use_cache else []
        seq = f"s{self.next_id}"
        self.next_id += 1
        if self.bm.allocate(seq, hits, length) is not None:
            self.tokens[seq] = tokens
            self.computed[seq] = len(hits) * BS
            self._check_prefix_contents(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), grow=st.integers(1, 9))
    def append(self, data: st.DataObject, grow: int) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        total = len(self.tokens[seq]) + grow
        if self.bm.append_slots(seq, total) is not None:
            self.tokens[seq] += [7] * grow

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.computed[seq] = len(self.tokens[seq])
        self.bm.cache_full_blocks(seq, self.tokens[seq], self.computed[seq])
        self._check_prefix_contents(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        num_full = self.computed[src] // BS
        shared = self.bm.block_ids(src)[:num_full]
        seq = f"s{self.next_id}"
        self.next_id += 1
        length = num_full * BS + 1
        if self.bm.allocate(seq, shared, length) is not None:
            self.tokens[seq] = self.tokens[src][: num_full * BS] + [5]
            self.computed[seq] = num_full * BS

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data: st.DataObject, preempt: bool) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens.pop(seq)
        self.computed.pop(seq)
        self.bm.free(seq)
        if preempt:  # recompute: come back under a new id, taking what the cache still has
            hits = self.bm.find_cached_prefix(tokens)
            new = f"s{self.next_id}"
            self.next_id += 1
            if self.bm.allocate(new, hits, len(tokens)) is not None:
                self.tokens[new] = tokens
                self.computed[new] = len(hits) * BS
                self._check_prefix_contents(new)

    @invariant()
    def accounting_holds(self) -> None:
        self.bm.check_invariants()
        held = {b for seq in self.tokens for b in self.bm.block_ids(seq)}
        assert len(held) + self.bm.num_free_blocks == self.bm.num_blocks


BlockManagerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase
