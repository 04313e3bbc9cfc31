"""A fabricated worker for scheduler tests: applies StepBatch deltas like the real
ModelRunner (and checks them), but "samples" a token computed from the sequence's
tokens instead of running a model, so scheduler tests run in microseconds per step.
``step`` and ``run_to_idle`` drive a scheduler core with one.

It is strict about the protocol: a running request it has no state for, a step that
computes past the known tokens, or a block table too short for the step fails loudly.
A sequence asking ``prompt_logprobs`` gets fabricated ones (prompt token p: logprob -p),
and must start at token 0 (no prefix-cache hit may skip a position it has to score).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.protocol import EngineOutput, PromptLogprobs, StepBatch, StepResult, TokenLogprobs

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler


@dataclass
class _Seq:
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int
    num_prompt: int = 0
    prompt_logprobs: bool = False


class FakeWorker:
    def __init__(self, block_size: int, vocab_size: int = 1000, avoid: frozenset[int] = frozenset()) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.avoid = avoid  # token ids never produced (e.g. EOS) unless forced
        self.seqs: dict[int, _Seq] = {}
        self.forced: dict[int, list[int]] = {}  # seq_id -> tokens to emit next, in order

    def next_token(self, tokens: list[int]) -> int:
        token = (sum(tokens[-3:]) * 31 + len(tokens)) % self.vocab_size
        while token in self.avoid:
            token = (token + 1) % self.vocab_size
        return token

    def execute(self, batch: StepBatch) -> StepResult:
        for rid in batch.finished_request_ids:
            self.seqs.pop(rid, None)
        for new in batch.new_requests:
            assert new.request_id not in self.seqs, f"{new.request_id} sent twice"
            wants = new.sampling_params.prompt_logprobs is not None
            assert not wants or new.num_computed_tokens == 0, f"{new.request_id} skips prompt tokens"
            self.seqs[new.request_id] = _Seq(list(new.token_ids), list(new.block_ids),
                                             new.num_computed_tokens, new.num_prompt_tokens, wants)
        for running in batch.running_requests:
            self.seqs[running.request_id].block_ids.extend(running.new_block_ids)
        result = StepResult(step_id=batch.step_id)
        for rid, n in zip(batch.scheduled_request_ids, batch.num_scheduled_tokens, strict=True):
            seq = self.seqs[rid]
            if seq.prompt_logprobs and seq.num_computed < seq.num_prompt - 1:
                end = min(seq.num_computed + n, seq.num_prompt - 1)
                result.prompt_logprobs.append(PromptLogprobs(rid, seq.num_computed + 1, [
                    TokenLogprobs(-float(p), 1, [], []) for p in range(seq.num_computed + 1, end + 1)]))
            seq.num_computed += n
            assert seq.num_computed <= len(seq.token_ids), f"{rid} computes past its tokens"
            assert len(seq.block_ids) * self.block_size >= seq.num_computed, f"{rid} lacks blocks"
            assert len(set(seq.block_ids)) == len(seq.block_ids)
            if seq.num_computed == len(seq.token_ids):
                forced = self.forced.get(rid)
                token = forced.pop(0) if forced else self.next_token(seq.token_ids)
                seq.token_ids.append(token)
                result.request_ids.append(rid)
                result.sampled_token_ids.append(token)
                result.logprobs.append(None)
        return result


def step(scheduler: Scheduler, worker: FakeWorker) -> tuple[StepBatch, list[EngineOutput]]:
    """One scheduler step run by ``worker``, the block invariant checked after it."""
    batch = scheduler.schedule()
    outs = scheduler.update(batch, worker.execute(batch))
    scheduler.check_invariants()
    return batch, outs


def run_to_idle(scheduler: Scheduler, worker: FakeWorker,
                max_steps: int = 5000) -> dict[tuple[str, int], EngineOutput]:
    """Steps until idle; each sequence's final output, with all its tokens."""
    done: dict[tuple[str, int], EngineOutput] = {}
    tokens: dict[tuple[str, int], list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        for out in step(scheduler, worker)[1]:
            key = (out.request_id, out.index)
            tokens.setdefault(key, []).extend(out.new_token_ids)
            if out.finished:
                out.new_token_ids = tokens[key]
                done[key] = out
    assert not scheduler.has_unfinished_requests(), "the scheduler did not drain"
    return done


class AheadDriver:
    """Drives a scheduler core as the loop does with async scheduling: step N+1 is
    scheduled and run before step N's ``update``. Between two ``step`` calls one step is
    out (run, not applied): an abort there lands mid-overlap. ``in_gap`` (if given) runs
    between step N+1's schedule and step N's update, where a sequence preempted by that
    schedule still has step N's token out."""

    def __init__(self, scheduler: Scheduler, worker: FakeWorker,
                 in_gap: Callable[[], None] | None = None) -> None:
        self.scheduler = scheduler
        self.worker = worker
        self.in_gap = in_gap
        self.ahead: tuple[StepBatch, StepResult] | None = None
        self.num_steps = 0

    def busy(self) -> bool:
        return self.ahead is not None or self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineOutput]:
        sched = self.scheduler
        if self.ahead is None:
            first = sched.schedule()
            self.ahead = (first, self.worker.execute(first))
        batch, result = self.ahead
        self.ahead = None
        if sched.has_unfinished_requests() and not sched.waits_for_results():
            nxt = sched.schedule()
            if nxt.scheduled_request_ids or nxt.finished_request_ids:
                self.ahead = (nxt, self.worker.execute(nxt))
        if self.in_gap is not None:
            self.in_gap()
        self.num_steps += 1
        outs = sched.update(batch, result)
        sched.check_invariants()
        return outs
