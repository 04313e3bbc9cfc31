"""Scheduler policy with a fabricated worker: admission, chunking, preemption, abort,
stop rules, n > 1 sharing, and the StepBatch deltas, with block accounting checked
after every step."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import RequestRejected, Scheduler, SchedulerConfig
from shared.sampling_params import SamplingParams
from support.fake_worker import FakeWorker, run_to_idle, step

EOS = 2


def make(num_blocks: int = 64, block_size: int = 4, **kw: object) -> tuple[Scheduler, FakeWorker]:
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, vocab_size=1000,
                          eos_token_ids=(EOS,), strict_invariants=True, **kw)  # type: ignore[arg-type]
    return Scheduler(cfg), FakeWorker(block_size, 1000, avoid=frozenset({EOS}))


def params(**kw: object) -> SamplingParams:
    kw.setdefault("temperature", 0.0)
    kw.setdefault("ignore_eos", False)
    return SamplingParams(**kw)  # type: ignore[arg-type]


def sid(s: Scheduler, request_id: str, index: int = 0) -> int:
    """The worker-link sequence id the scheduler minted for one child of a request."""
    return s.requests[request_id][index].seq_id


def assert_idle(s: Scheduler) -> None:
    s.check_invariants()
    st = s.stats()
    assert (st.running, st.waiting, st.kv_usage) == (0, 0, 0.0), st
    assert s.requests == {}


def prompt(n: int, start: int = 10) -> list[int]:
    return [start + i for i in range(n)]


# -- admission ------------------------------------------------------------------------

def test_rejects_what_can_never_fit_and_allocates_nothing() -> None:
    s, _ = make(num_blocks=4, block_size=4, max_model_len=100)
    with pytest.raises(RequestRejected, match="4 blocks") as err:
        s.add_request("big", prompt(16), params())  # 16 + 1 tokens need 5 blocks
    assert err.value.code == "too_long"
    with pytest.raises(RequestRejected, match="100"):
        s.add_request("long", prompt(100), params())
    with pytest.raises(RequestRejected, match="vocab|\\[0, 1000\\)"):
        s.add_request("oov", [5, 1000], params())
    s.add_request("ok", prompt(3), params(max_tokens=2))
    with pytest.raises(RequestRejected) as dup:
        s.add_request("ok", prompt(3), params())
    assert dup.value.code == "duplicate_id"
    assert s.stats().waiting == 1 and s.block_manager.usage == 0.0


def test_waiting_admitted_in_priority_then_arrival_order() -> None:
    s, w = make(max_num_seqs=1)
    s.add_request("a", prompt(3), params(max_tokens=1))
    s.add_request("b", prompt(3), params(max_tokens=1), priority=-1)
    s.add_request("c", prompt(3), params(max_tokens=1))
    seqs = {sid(s, rid): rid for rid in ("a", "b", "c")}
    order = []
    while s.has_unfinished_requests():
        batch, _ = step(s, w)
        order += [seqs[r.request_id] for r in batch.new_requests]
    assert order == ["b", "a", "c"]


# -- step messages ----------------------------------------------------------------------

def test_step_batch_is_a_delta() -> None:
    s, w = make(block_size=4)
    s.add_request("r", prompt(6), params(max_tokens=8))
    r0 = sid(s, "r")
    b0, _ = step(s, w)
    assert [n.request_id for n in b0.new_requests] == [r0]
    assert b0.new_requests[0].token_ids == prompt(6) and len(b0.new_requests[0].block_ids) == 2
    assert b0.num_scheduled_tokens == [6]
    b1, _ = step(s, w)  # token 7 -> still in block 1
    assert b1.new_requests == [] and b1.running_requests == [] and b1.num_scheduled_tokens == [1]
    b2, _ = step(s, w)  # token 8 -> still block 1; token 9 (next) needs block 2
    b3, _ = step(s, w)
    assert [len(r.new_block_ids) for r in b2.running_requests + b3.running_requests] == [1]
    while s.has_unfinished_requests():
        step(s, w)
    assert s.schedule().finished_request_ids == [r0]
    assert_idle(s)


# -- chunked prefill ------------------------------------------------------------------

def test_chunked_prefill_keeps_decodes_going_and_respects_budget() -> None:
    s, w = make(num_blocks=200, block_size=4, max_num_batched_tokens=32)
    s.add_request("short", prompt(5), params(max_tokens=30))
    step(s, w)
    s.add_request("long", prompt(200, start=500), params(max_tokens=3))
    short0, long0 = sid(s, "short"), sid(s, "long")
    chunks = []
    while s.block_manager.holds(long0) is False or s.requests["long"][0].num_computed_tokens < 200:
        batch, _ = step(s, w)
        sched = dict(zip(batch.scheduled_request_ids, batch.num_scheduled_tokens))
        assert sched.get(short0) == 1, "the decode must get a token every step"
        assert batch.scheduled_request_ids[0] == short0, "one-token sequences come first"
        assert batch.total_num_scheduled_tokens <= 32
        chunks.append(sched[long0])
    assert sum(chunks) == 200 and len(chunks) == -(-200 // 31)
    run_to_idle(s, w)
    assert_idle(s)


def test_chunked_prefill_gives_the_same_tokens() -> None:
    results = []
    for budget in (16, 4096):
        s, w = make(num_blocks=200, block_size=4, max_num_batched_tokens=budget)
        s.add_request("long", prompt(300), params(max_tokens=10))
        results.append(run_to_idle(s, w)[("long", 0)].new_token_ids)
    assert results[0] == results[1] and len(results[0]) == 10


# -- preemption ---------------------------------------------------------------------

def test_preemption_takes_the_newest_and_oldest_always_progresses() -> None:
    s, w = make(num_blocks=8, block_size=4, max_model_len=64)
    for i in range(4):
        s.add_request(f"r{i}", prompt(4, 10 * i), params(max_tokens=20))
    request_of = {sid(s, f"r{i}"): f"r{i}" for i in range(4)}
    step(s, w)  # 4 prompts x 1 block each: 4 free blocks left
    preempted_order = []
    oldest_progress = []
    while s.has_unfinished_requests():
        before = s.requests.get("r0", [None])[0]
        n0 = before.num_tokens if before else None
        batch, _ = step(s, w)
        preempted_order += [request_of[q] for q in batch.finished_request_ids
                            if s.requests.get(request_of[q])]
        if before is not None and not before.status.finished:
            oldest_progress.append(before.num_tokens > n0)
    assert s.stats().num_preemptions > 0
    assert "r0" not in preempted_order, "the oldest request was preempted"
    assert all(oldest_progress), "the oldest request missed a step"
    assert_idle(s)


def test_preempted_requests_give_the_same_tokens() -> None:
    outs = []
    for num_blocks in (400, 10):
        s, w = make(num_blocks=num_blocks, block_size=4, max_num_seqs=16)
        for i in range(16):
            s.add_request(f"r{i}", prompt(3 + i % 5, 7 * i), params(max_tokens=12 + i))
        outs.append({k: v.new_token_ids for k, v in run_to_idle(s, w).items()})
        assert_idle(s)
    assert s.stats().num_preemptions >= 5
    assert outs[0] == outs[1]


def test_decode_at_the_pool_ceiling_stops_with_length() -> None:
    s, w = make(num_blocks=4, block_size=4, max_model_len=1000)
    s.add_request("r", prompt(5), params(max_tokens=100))
    out = run_to_idle(s, w)[("r", 0)]
    assert out.finish_reason == "length"
    # every slot of the 4 blocks was computed; the last token sampled needs no slot
    assert len(out.new_token_ids) == 16 - 5 + 1
    assert_idle(s)


# -- stop rules ---------------------------------------------------------------------

def test_stop_rules() -> None:
    s, w = make(max_model_len=12)
    s.add_request("eos", prompt(3), params(max_tokens=50))
    s.add_request("eos-ignored", prompt(3), params(max_tokens=4, ignore_eos=True))
    s.add_request("stop-id", prompt(3), params(max_tokens=50, stop_token_ids=[77]))
    s.add_request("min", prompt(3), params(max_tokens=50, min_tokens=2))
    s.add_request("model-len", prompt(3), params(max_tokens=None))
    for rid in ("eos", "eos-ignored", "min"):
        w.forced[sid(s, rid)] = [5, EOS, EOS, 6]
    w.forced[sid(s, "stop-id")] = [5, 77, 8]
    done = run_to_idle(s, w)
    assert done[("eos", 0)].new_token_ids == [5, EOS] and done[("eos", 0)].finish_reason == "stop"
    assert done[("eos-ignored", 0)].new_token_ids[:4] == [5, EOS, EOS, 6]
    assert done[("eos-ignored", 0)].finish_reason == "length"
    assert done[("stop-id", 0)].new_token_ids == [5, 77]
    assert done[("stop-id", 0)].stop_reason == 77
    # min_tokens=2: the worker's sampler masks EOS at outputs 1-2; the scheduler must not
    # stop before, even if it sees one
    assert done[("min", 0)].new_token_ids == [5, EOS, EOS]
    assert len(done[("model-len", 0)].new_token_ids) == 12 - 3
    assert done[("model-len", 0)].finish_reason == "length"
    assert_idle(s)


# -- abort ----------------------------------------------------------------------------

def test_abort_in_every_state_frees_blocks_exactly_once() -> None:
    s, w = make(num_blocks=12, block_size=4, max_num_batched_tokens=8, max_model_len=200)
    s.add_request("running", prompt(4), params(max_tokens=100))
    s.add_request("prefilling", prompt(30), params(max_tokens=100))
    held = {sid(s, "running"), sid(s, "prefilling")}
    step(s, w)
    step(s, w)
    assert s.requests["running"][0].status == RequestStatus.RUNNING
    prefilling = s.requests["prefilling"][0]
    assert 0 < prefilling.num_computed_tokens < 30
    s.add_request("waiting", prompt(4), params(max_tokens=100))
    held.add(sid(s, "waiting"))
    # run until something is preempted
    while not any(r.status == RequestStatus.PREEMPTED for rs in s.requests.values() for r in rs):
        step(s, w)
    states = {rid: rs[0].status for rid, rs in s.requests.items()}
    assert RequestStatus.PREEMPTED in states.values()
    for rid in list(s.requests):
        outs = s.abort_request([rid])
        assert [o.finish_reason for o in outs] == ["abort"]
        assert s.abort_request([rid]) == []  # a second abort is a no-op
        s.check_invariants()
    assert_idle(s)
    # workers are told to drop every sequence they held
    assert set(s.schedule().finished_request_ids) <= held


def test_abort_mid_prefill_and_waiting_explicitly() -> None:
    s, w = make(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    s.add_request("p", prompt(40), params(max_tokens=5))
    step(s, w)
    assert 0 < s.requests["p"][0].num_computed_tokens < 40 and s.block_manager.usage > 0
    s.add_request("w", prompt(4), params(max_tokens=5))
    assert s.abort_request(["p", "w"])[0].finish_reason == "abort"
    assert_idle(s)


def test_abort_racing_the_step_is_ignored() -> None:
    s, w = make()
    s.add_request("r", prompt(4), params(max_tokens=5))
    batch = s.schedule()
    result = w.execute(batch)
    s.abort_request(["r"])
    assert s.update(batch, result) == []
    assert_idle(s)


# -- n > 1 ------------------------------------------------------------------------------

def test_n_children_share_prompt_blocks_and_are_all_freed() -> None:
    s, w = make(num_blocks=64, block_size=4)
    s.add_request("r", prompt(18), params(n=4, temperature=1.0, seed=1, max_tokens=6))
    children = [sid(s, "r", i) for i in range(4)]
    b0, _ = step(s, w)
    assert [n.request_id for n in b0.new_requests] == children[:1], "child 0 computes the prompt alone"
    b1, _ = step(s, w)
    forks = {n.request_id: n for n in b1.new_requests}
    assert set(forks) == set(children[1:])
    first_blocks = s.block_manager.block_ids(children[0])[:4]  # (18 - 1) // 4 full prompt blocks
    for child in forks.values():
        assert child.block_ids[:4] == first_blocks
        assert child.num_computed_tokens == 16
    assert all(s.block_manager.blocks[b].ref_count == 4 for b in first_blocks)
    assert [c.sampling_params.seed for c in s.requests["r"]] == [1, 2, 3, 4]
    done = run_to_idle(s, w)
    assert sorted(done) == [("r", i) for i in range(4)]
    assert_idle(s)


def test_abort_frees_every_child() -> None:
    s, w = make(num_blocks=64, block_size=4)
    s.add_request("r", prompt(18), params(n=4, max_tokens=50))
    step(s, w)
    step(s, w)
    assert len(s.running) == 4
    assert len(s.abort_request(["r"])) == 4
    assert_idle(s)


# -- random traffic ---------------------------------------------------------------------

class SchedulerMachine(RuleBasedStateMachine):
    """Random adds (n up to 3, shared prefixes), aborts and steps on a tight pool."""

    def __init__(self) -> None:
        super().__init__()
        self.s, self.w = make(num_blocks=10, block_size=4, max_num_batched_tokens=12, max_model_len=40)
        self.ids = 0

    @rule(length=st.integers(1, 30), n=st.integers(1, 3), max_tokens=st.integers(1, 12),
          shared=st.booleans())
    def add(self, length: int, n: int, max_tokens: int, shared: bool) -> None:
        tokens = [3 + (i if shared else i * 7 + self.ids) % 50 for i in range(length)]
        try:
            self.s.add_request(f"q{self.ids}", tokens, params(n=n, max_tokens=max_tokens, seed=1,
                                                              temperature=1.0))
        except RequestRejected:
            pass
        self.ids += 1

    @precondition(lambda self: self.s.requests)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.s.requests)))
        self.s.abort_request([rid])

    @rule(steps=st.integers(1, 5))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            step(self.s, self.w)

    @invariant()
    def accounting_holds(self) -> None:
        self.s.check_invariants()

    def teardown(self) -> None:
        run_to_idle(self.s, self.w)
        assert_idle(self.s)


SchedulerMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
test_scheduler_state_machine = SchedulerMachine.TestCase
