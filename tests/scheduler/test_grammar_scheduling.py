"""Structured output in the scheduler core, with real xgrammar over SmolLM2's tokenizer and
a fabricated worker that samples inside each step's bitmask: a request whose grammar
compiles waits in the queue while others run; a failed or late compile ends its request
with a typed error and nothing held; matchers advance with every token, end the sequence
when the grammar is complete, survive preemption, and are per child with n > 1."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from services.scheduler.request import RequestStatus
from services.scheduler.scheduler import RequestRejected, Scheduler, SchedulerConfig
from services.scheduler.structured_output import StructuredOutputManager
from shared.protocol import EngineOutput, StepBatch, StepResult
from shared.sampling_params import SamplingParams, StructuredOutputsParams
from support.fake_worker import FakeWorker, run_to_idle, step

VOCAB = 49152 + 64  # SmolLM2's tokenizer under padded logits
EOS = 2
EMAIL = r"[a-z]{1,6}@[a-z]{1,4}\.(com|org)"


class MaskedWorker(FakeWorker):
    """FakeWorker whose sequences under a grammar sample a random token their mask allows;
    it checks that the masks name exactly sequences that sample this step."""

    def __init__(self, block_size: int, seed: int = 0) -> None:
        super().__init__(block_size, VOCAB, avoid=frozenset({EOS}))
        self.rng = random.Random(seed)
        self.masked_steps = 0

    def execute(self, batch: StepBatch) -> StepResult:
        result = super().execute(batch)
        if not batch.grammar_seq_ids:
            return result
        self.masked_steps += 1
        rows = np.frombuffer(batch.grammar_bitmasks, dtype="<i4").reshape(len(batch.grammar_seq_ids), -1)
        assert rows.shape[1] == (VOCAB + 31) // 32
        for seq_id, words in zip(batch.grammar_seq_ids, rows, strict=True):
            assert seq_id in result.request_ids, f"a mask for {seq_id}, which does not sample"
            allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little"))
            token = int(self.rng.choice(allowed))
            i = result.request_ids.index(seq_id)
            result.sampled_token_ids[i] = token
            self.seqs[seq_id].token_ids[-1] = token
        return result


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Any:
    from shared.tokenizer_loader import load_tokenizer

    return load_tokenizer(smollm2_dir)


@pytest.fixture
def manager(smollm2_dir: Path) -> Iterator[StructuredOutputManager]:
    m = StructuredOutputManager(smollm2_dir, VOCAB, [EOS], compile_timeout_s=60.0)
    yield m
    m.close()


def make(manager: StructuredOutputManager | None, num_blocks: int = 64,
         **kw: Any) -> tuple[Scheduler, MaskedWorker]:
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=4, vocab_size=VOCAB,
                          eos_token_ids=(EOS,), strict_invariants=True, **kw)
    return Scheduler(cfg, structured_output=manager), MaskedWorker(4)


def params(so: StructuredOutputsParams | None = None, **kw: Any) -> SamplingParams:
    kw.setdefault("temperature", 1.0)
    kw.setdefault("max_tokens", 40)
    return SamplingParams(structured_outputs=so, **kw)


def run(s: Scheduler, w: MaskedWorker) -> dict[tuple[str, int], EngineOutput]:
    """Steps until idle, every grammar compiled first; each sequence's final output."""
    for request_id in list(s.requests):
        compiled(s, request_id)
    return run_to_idle(s, w, max_steps=2000)


def compiled(s: Scheduler, request_id: str) -> None:
    """Wait (bounded) for a request's grammar to finish compiling, failed or not."""
    grammar = s.requests[request_id][0].grammar
    if grammar is not None:
        grammar.entry.future.exception(timeout=60)


def text(tokenizer: Any, out: EngineOutput) -> str:
    return str(tokenizer.decode(out.new_token_ids, skip_special_tokens=True))


def assert_idle(s: Scheduler) -> None:
    s.check_invariants()
    st = s.stats()
    assert (st.running, st.waiting, st.kv_usage) == (0, 0, 0.0), st
    assert s.requests == {} and s._num_grammar_seqs == 0


def test_compiling_request_waits_in_the_queue_while_others_run(
        manager: StructuredOutputManager, tokenizer: Any) -> None:
    s, w = make(manager)
    with manager._init_lock:  # holds every compile at its start: a grammar "compiling"
        s.add_request("json", [10, 11, 12], params(StructuredOutputsParams(json_object=True)))
        s.add_request("free", [20, 21, 22], params(max_tokens=3))
        for _ in range(3):
            batch, _ = step(s, w)
            assert [r.status for r in s.requests["json"]] == [RequestStatus.WAITING_FOR_GRAMMAR]
            assert s.requests["json"][0].seq_id not in batch.scheduled_request_ids
            assert batch.grammar_seq_ids == []
        assert "free" not in s.requests, "the free request ran and finished meanwhile"
    compiled(s, "json")
    done = run(s, w)
    assert done[("json", 0)].finish_reason in ("stop", "length")
    assert_idle(s)


def test_compile_failure_is_a_typed_error_and_nothing_is_held(
        manager: StructuredOutputManager) -> None:
    s, w = make(manager)
    bad = StructuredOutputsParams(regex="(abc")  # the frontend would refuse it; the core too
    s.add_request("bad", [10, 11], params(bad, n=2))
    s.add_request("ok", [12, 13], params(max_tokens=2))
    compiled(s, "bad")
    run(s, w)
    errors = s.take_errors()
    assert [(rid, code) for rid, code, _ in errors] == [("bad", "invalid_request")]
    assert "parenthesis" in errors[0][2]
    assert_idle(s)
    with pytest.raises(RequestRejected, match="parenthesis"):  # known now: refused at once
        s.add_request("bad-again", [10, 11], params(bad))
    assert_idle(s)


def test_a_compile_past_its_time_limit_fails_its_requests(smollm2_dir: Path) -> None:
    now = [0.0]
    m = StructuredOutputManager(smollm2_dir, VOCAB, [EOS], compile_timeout_s=5.0,
                                clock=lambda: now[0])
    s, w = make(m)
    with m._init_lock:
        s.add_request("slow", [10, 11], params(StructuredOutputsParams(regex=EMAIL)))
        step(s, w)
        assert s.take_errors() == []
        now[0] = 6.0
        step(s, w)
    assert [(rid, msg) for rid, _, msg in s.take_errors()] == [
        ("slow", "structured output: the grammar did not compile within 5s")]
    assert_idle(s)
    m.close()


def test_matchers_advance_and_a_complete_output_stops(
        manager: StructuredOutputManager, tokenizer: Any) -> None:
    s, w = make(manager)
    choices = ["yes", "no way", "maybe"]
    for i in range(4):
        s.add_request(f"c{i}", [10 + i, 11], params(StructuredOutputsParams(choice=choices)))
    # ignore_eos: the grammar's end still ends it; a free request beside them is unmasked
    s.add_request("r", [30, 31], params(StructuredOutputsParams(regex=EMAIL), ignore_eos=True))
    s.add_request("free", [40, 41], params(max_tokens=5))
    done = run(s, w)
    for i in range(4):
        out = done[(f"c{i}", 0)]
        assert out.finish_reason == "stop" and out.new_token_ids[-1] == EOS
        assert text(tokenizer, out) in choices
    assert done[("r", 0)].finish_reason == "stop"
    assert re.fullmatch(EMAIL, text(tokenizer, done[("r", 0)]))
    assert done[("free", 0)].finish_reason == "length"
    assert w.masked_steps > 0
    assert_idle(s)


def test_n_children_and_preemption_keep_their_matchers(
        manager: StructuredOutputManager, tokenizer: Any) -> None:
    s, w = make(manager, num_blocks=9)  # 36 slots for 3 x (4 + up to ~12) tokens: preempts
    s.add_request("n3", [10, 11, 12, 13], params(StructuredOutputsParams(regex=EMAIL), n=3,
                                                 seed=5, max_tokens=30))
    s.add_request("other", [50, 51, 52, 53], params(StructuredOutputsParams(regex=EMAIL),
                                                    max_tokens=30))
    done = run(s, w)
    assert s.stats().num_preemptions > 0, "the pool was meant to force a preemption"
    outs = [done[("n3", i)] for i in range(3)] + [done[("other", 0)]]
    for out in outs:
        assert out.finish_reason == "stop", out
        assert re.fullmatch(EMAIL, text(tokenizer, out)), text(tokenizer, out)
    assert_idle(s)


def test_a_token_outside_the_grammar_aborts_only_that_sequence(
        manager: StructuredOutputManager) -> None:
    s, w = make(manager)
    s.add_request("a", [10, 11], params(StructuredOutputsParams(choice=["yes"])))
    s.add_request("b", [12, 13], params(max_tokens=3))
    compiled(s, "a")
    batch = s.schedule()
    result = FakeWorker.execute(w, batch)  # the plain fake worker ignores the masks
    seq_a = s.requests["a"][0].seq_id
    result.sampled_token_ids[result.request_ids.index(seq_a)] = 40000  # not "yes"
    outs = {o.request_id: o for o in s.update(batch, result)}
    assert outs["a"].finish_reason == "abort" and not outs["b"].finished
    run(s, w)
    assert_idle(s)


def test_without_a_manager_a_constraint_is_rejected() -> None:
    s, _ = make(None)
    with pytest.raises(RequestRejected, match="not available"):
        s.add_request("x", [1, 2], params(StructuredOutputsParams(regex="a")))
    assert_idle(s)
