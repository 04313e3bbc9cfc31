"""The scheduler core: continuous batching over the block manager, no sockets.

``schedule()`` builds one step: running sequences first (decodes, then the next
chunk of prompts being prefilled), then waiting ones in (priority, arrival) order
while the token budget (``max_num_batched_tokens``), the sequence cap
(``max_num_seqs``) and free blocks allow. There are no separate prefill and decode
phases: a long prompt is cut into chunks that share steps with decodes.

When a running sequence cannot get a block, the newest running sequence is
preempted (recompute: its blocks are freed, it goes back to waiting, and later
resumes as a new request whose prefix is mostly a prefix-cache hit). ``running``
is kept sorted oldest first, so the oldest sequence is never the victim; if it is
alone and still short of blocks, it has reached the pool ceiling and finishes with
``length``. A request that can never fit the pool is rejected at admission.

``update(batch, result)`` advances the sequences the step computed, appends the
sampled tokens, applies stop rules (EOS/stop ids, max_tokens, max_model_len), frees
finished sequences' blocks in the same step, and returns per-sequence outputs.

Async scheduling: ``schedule()`` may run again before the last step's ``update``
(the loop publishes step N+1 while the workers run step N). It schedules each
sequence as if the steps in flight had run: a decode in step N is scheduled for one
more token in N+1, the token N samples, which the workers already hold when they run
N+1 (their request table appends it), so no round trip through the scheduler sits
between two steps. ``Request.num_tokens_ahead`` / ``num_samples_ahead`` count what the
published, unapplied steps hold. A sequence that may end with the token in flight is
not scheduled ahead when the scheduler can tell (``max_tokens``, ``max_model_len``),
nor one under a grammar (its next mask needs that token); one that ends by a stop
token is, and the workers' extra token of it is discarded at the next ``update``.
While a sequence under a grammar has its token out, the callers do not schedule ahead
at all (``waits_for_results``): it then samples every step, as without async
scheduling, instead of every other one.
A sequence aborted, preempted or finished while its steps are out keeps its blocks'
reuse behind those steps: the workers run steps in order, and blocks freed now are
handed out by a later ``schedule()`` only. A preempted sequence still takes the token
its last step sampled (the step ran on intact blocks) and is not resumed until its
results are in. Tokens are the same with async scheduling on and off: sampling
depends only on a sequence's own tokens and seed, not on the batch.

Prompt logprobs: the sequence of a request asking ``prompt_logprobs`` (child 0 only)
takes no prefix-cache hit, so the workers score every prompt position as its chunks
run; ``update`` collects the chunks' logprobs and hands them over with its first token.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from services.scheduler.block_manager import BlockManager
from services.scheduler.metrics import EngineMetrics, SchedulerStats
from services.scheduler.request import FINISH_REASONS, Request, RequestStatus
from services.scheduler.structured_output import (
    GrammarEntry,
    GrammarFailed,
    SequenceGrammar,
    StructuredOutputManager,
)
from shared.protocol import (
    EngineOutput,
    NewRequest,
    RunningRequest,
    StepBatch,
    StepResult,
    TokenLogprobs,
)
from shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shared.config import EngineSettings

_MASK64 = (1 << 64) - 1
log = logging.getLogger("pagoda.scheduler")


class RequestRejected(ValueError):
    """A request the scheduler will not take; nothing was allocated for it."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class SchedulerConfig:
    num_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    vocab_size: int = 0  # 0 = do not check token ids
    enable_prefix_caching: bool = True
    eos_token_ids: tuple[int, ...] = ()
    # check block accounting whenever the scheduler goes idle: raise (tests) or count
    strict_invariants: bool = False
    # record the prefix cache's changes as vLLM KV events (block_manager.take_events)
    enable_kv_events: bool = False

    def __post_init__(self) -> None:
        for name in ("num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_settings(
        cls, engine: EngineSettings, *, num_blocks: int, max_model_len: int, vocab_size: int,
        eos_token_ids: Iterable[int] = (), strict_invariants: bool = False,
        enable_kv_events: bool = False,
    ) -> SchedulerConfig:
        """The one place the scheduler's config is derived: the engine settings, plus what
        the workers report (KV pool size, max_model_len, vocab, EOS ids; the smallest over
        the ranks) and whether a broken invariant is fatal (``ProcessSettings.testing``)."""
        return cls(
            num_blocks=num_blocks, block_size=engine.block_size, max_num_seqs=engine.max_num_seqs,
            max_num_batched_tokens=engine.max_num_batched_tokens, max_model_len=max_model_len,
            vocab_size=vocab_size, enable_prefix_caching=engine.enable_prefix_caching,
            eos_token_ids=tuple(eos_token_ids), strict_invariants=strict_invariants,
            enable_kv_events=enable_kv_events,
        )


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock: Callable[[], float] = time.time,
                 structured_output: StructuredOutputManager | None = None) -> None:
        self.config = config
        self.clock = clock  # wall-clock seconds, as the frontends' arrival times
        # None: requests with structured_outputs are rejected
        self.structured_output = structured_output
        self._compiling: list[Request] = []  # WAITING_FOR_GRAMMAR, in the waiting queue
        self._num_grammar_seqs = 0  # live sequences with a grammar (0: steps skip the masks)
        # (request id, code, message) of requests that failed after admission (a grammar
        # that did not compile): the caller answers each with a RequestError (take_errors)
        self._errors: list[tuple[str, str, str]] = []
        self.metrics = EngineMetrics(config.max_model_len)
        self.block_manager = BlockManager(config.num_blocks, config.block_size,
                                          config.enable_prefix_caching, config.enable_kv_events)
        self.requests: dict[str, list[Request]] = {}  # request_id -> its children
        self.running: list[Request] = []  # sorted by order_key: oldest first
        self.waiting: list[Request] = []  # sorted by order_key
        self._arrivals = itertools.count()
        self._step_ids = itertools.count()
        self._seq_ids = itertools.count()  # the worker link's compact sequence ids
        # seq ids whose worker state must be dropped in the next step
        self._dropped_seq_ids: list[int] = []
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._num_preemptions = 0
        self._invariant_failures = 0
        # sequences that ended while scheduling (pool ceiling): reported by the next update
        self._ceiling_outputs: list[EngineOutput] = []
        # step id -> its sequences in batch order, for each published step not updated yet
        self._published: dict[int, list[Request]] = {}

    # -- requests in and out ---------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int = 0, arrival_time: float | None = None,
    ) -> None:
        """Validate and queue a request; raises RequestRejected with nothing allocated.

        ``arrival_time`` (wall clock) is when the client's request arrived; default now.
        """
        self._validate(request_id, prompt_token_ids, params)
        grammar = self._grammar_entry(params)
        arrival = self.clock() if arrival_time is None else arrival_time
        prompt_len = len(prompt_token_ids)
        max_tokens = self.config.max_model_len - prompt_len
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(self.config.eos_token_ids)
        )
        order_key = (priority, next(self._arrivals))
        children = []
        for index in range(params.n):
            child_params = params
            if params.n > 1:
                # each child its own stream; seed + index keeps n > 1 reproducible (as vLLM);
                # the prompt's logprobs are child 0's to compute
                seed = None if params.seed is None else _wrap_i64(params.seed + index)
                child_params = msgspec.structs.replace(
                    params, n=1, seed=seed,
                    prompt_logprobs=params.prompt_logprobs if index == 0 else None)
            children.append(Request(
                request_id=request_id, index=index, token_ids=list(prompt_token_ids),
                num_prompt_tokens=prompt_len, sampling_params=child_params, order_key=order_key,
                max_tokens=max_tokens, stop_ids=stop_ids, seq_id=next(self._seq_ids),
                arrival_time=arrival,
                prompt_logprobs=None if child_params.prompt_logprobs is None else [None],
            ))
        if grammar is not None:
            self._await_grammar(children, grammar)
        self.requests[request_id] = children
        for child in children:
            bisect.insort(self.waiting, child, key=_order)

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        cfg = self.config
        if request_id in self.requests:
            raise RequestRejected("duplicate_id", f"request id {request_id!r} is already in use")
        if not prompt:
            raise RequestRejected("invalid_request", "the prompt is empty")
        if len(prompt) >= cfg.max_model_len:
            raise RequestRejected(
                "too_long",
                f"the prompt has {len(prompt)} tokens; with max_model_len {cfg.max_model_len} "
                f"at most {cfg.max_model_len - 1} leave room for one output token",
            )
        needed = self.block_manager.blocks_needed(len(prompt) + 1)
        if needed > cfg.num_blocks:
            raise RequestRejected(
                "too_long",
                f"the prompt has {len(prompt)} tokens and needs {needed} KV blocks; "
                f"the pool has {cfg.num_blocks} blocks of {cfg.block_size} tokens",
            )
        if cfg.vocab_size and (min(prompt) < 0 or max(prompt) >= cfg.vocab_size):
            raise RequestRejected(
                "invalid_request", f"prompt token ids must be in [0, {cfg.vocab_size})"
            )
        if cfg.vocab_size and any(not 0 <= t < cfg.vocab_size for t in params.stop_token_ids):
            raise RequestRejected("invalid_request", f"stop_token_ids must be in [0, {cfg.vocab_size})")
        if cfg.vocab_size and params.logit_bias and any(
                not 0 <= t < cfg.vocab_size for t in params.logit_bias):
            raise RequestRejected("invalid_request", f"logit_bias token ids must be in [0, {cfg.vocab_size})")
        if params.n > 1 and params.n > cfg.max_num_seqs:
            raise RequestRejected("invalid_request", f"n={params.n} exceeds max_num_seqs {cfg.max_num_seqs}")

    def abort_request(self, request_ids: Iterable[str], index: int | None = None) -> list[EngineOutput]:
        """Abort the live children of these requests (only child ``index`` if given);
        their blocks are freed exactly once.

        Unknown or already finished ids are ignored (an abort may race a finish).
        """
        outputs = []
        for request_id in request_ids:
            for req in list(self.requests.get(request_id, ())):
                if req.status.finished or (index is not None and req.index != index):
                    continue
                if req.status == RequestStatus.RUNNING:
                    self.running.remove(req)
                else:
                    self.waiting.remove(req)
                self._finish(req, RequestStatus.FINISHED_ABORTED)
                outputs.append(self._output(req, [], []))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def waits_for_results(self) -> bool:
        """Whether the next step should wait for the steps in flight instead of running
        ahead of them: a running sequence under a grammar has its token out (its next
        mask needs it). Scheduled ahead anyway, it would get a token every other step."""
        return bool(self._num_grammar_seqs) and any(
            r.grammar is not None and r.num_samples_ahead for r in self.running)

    # -- one step --------------------------------------------------------------------
    def schedule(self) -> StepBatch:
        """One step. ``scheduled_request_ids`` is in the order the runner executes:
        every one-token sequence (decodes, and a last prompt token) first, then the
        multi-token chunks, so workers neither re-sort the batch nor the results."""
        if self._compiling:
            self._poll_grammars()
        # seq_id -> (request, tokens this step, blocks added this step)
        scheduled: dict[int, tuple[Request, int, list[int]]] = {}
        preemptions_before = self._num_preemptions
        budget = self._schedule_running(scheduled, self.config.max_num_batched_tokens)
        # after a preemption the pool is short: admitting now would only churn
        admitted = set() if self._num_preemptions > preemptions_before else self._schedule_waiting(scheduled, budget)
        new_requests: list[NewRequest] = []
        running_requests: list[RunningRequest] = []
        singles: list[tuple[int, int]] = []
        chunks: list[tuple[int, int]] = []
        for req, n, new_blocks in scheduled.values():
            if req in admitted:
                new_requests.append(NewRequest(
                    request_id=req.seq_id, token_ids=list(req.token_ids),
                    num_prompt_tokens=req.num_prompt_tokens, sampling_params=req.sampling_params,
                    block_ids=list(self.block_manager.block_ids(req.seq_id)),
                    num_computed_tokens=req.num_computed_tokens,
                ))
                req.on_worker = True
            elif new_blocks:
                # running sequences without new blocks need no delta entry at all
                running_requests.append(RunningRequest(req.seq_id, new_blocks))
            (singles if n == 1 else chunks).append((req.seq_id, n))
        order = singles + chunks
        # the sequences whose last known token this step computes, so it samples theirs
        sampling = {seq_id for seq_id, (req, n, _) in scheduled.items()
                    if req.num_computed_ahead + n == req.num_known_tokens}
        grammar_seq_ids, grammar_bitmasks = self._grammar_bitmasks(scheduled, order, sampling)
        batch = StepBatch(
            step_id=next(self._step_ids), new_requests=new_requests,
            running_requests=running_requests,
            scheduled_request_ids=[seq_id for seq_id, _ in order],
            num_scheduled_tokens=[n for _, n in order],
            finished_request_ids=self._dropped_seq_ids,
            grammar_seq_ids=grammar_seq_ids, grammar_bitmasks=grammar_bitmasks,
        )
        self._dropped_seq_ids = []
        if order:
            self._published[batch.step_id] = [scheduled[seq_id][0] for seq_id, _ in order]
            bm, block_size = self.block_manager, self.config.block_size
            for seq_id, n in order:
                req = scheduled[seq_id][0]
                req.num_tokens_ahead += n
                req.num_samples_ahead += seq_id in sampling
                # blocks this step fills go into the prefix cache now, as vLLM caches at
                # allocation: a later step that hits them runs after this one has written
                # them, and with async scheduling the next schedule() comes before this
                # step's update (a token still in flight is hashed by that update)
                if n > 1 or req.num_computed_ahead % block_size == 0:
                    bm.cache_full_blocks(seq_id, req.token_ids,
                                         min(req.num_computed_ahead, req.num_tokens))
        if not self.running and not self.waiting:
            self.check_invariants_on_idle()
        return batch

    def _schedule_running(self, scheduled: dict[int, tuple[Request, int, list[int]]], budget: int) -> int:
        # decodes first so a long prefill never starves them; then prompt chunks, oldest first
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self.running:
            if r.num_samples_ahead and self._needs_result_first(r):
                continue
            (decodes if r.num_known_tokens - r.num_computed_ahead == 1 else prefills).append(r)
        running = RequestStatus.RUNNING
        for req in itertools.chain(decodes, prefills):
            if budget <= 0:
                break
            if req.status is not running:
                continue  # preempted earlier in this pass
            n = min(req.num_known_tokens - req.num_computed_ahead, budget)
            new_blocks = self._grow_or_preempt(req, req.num_computed_ahead + n, scheduled)
            if new_blocks is None:
                continue
            scheduled[req.seq_id] = (req, n, new_blocks)
            budget -= n
        # preemption may have taken back tokens of victims scheduled earlier this step
        return self.config.max_num_batched_tokens - sum(n for _, n, _ in scheduled.values())

    def _needs_result_first(self, req: Request) -> bool:
        """Whether a sequence with a token in flight waits for it before its next step:
        that token may end it at a length limit, or its grammar's next mask needs it."""
        return (req.grammar is not None
                or req.num_output_tokens + req.num_samples_ahead >= req.max_tokens
                or req.num_known_tokens >= self.config.max_model_len)

    def _grow_or_preempt(
        self, req: Request, num_tokens: int, scheduled: dict[int, tuple[Request, int, list[int]]]
    ) -> list[int] | None:
        """Blocks for req's first num_tokens tokens, preempting newer sequences while short."""
        bm = self.block_manager
        while True:
            new_blocks = bm.append_slots(req.seq_id, num_tokens)
            if new_blocks is not None:
                return new_blocks
            victim = self.running[-1]
            if victim is req:
                if len(self.running) == 1:
                    if req.results_pending:  # its token in flight comes first, as in order
                        return None
                    # alone and still short: the pool ceiling; stop it rather than spin
                    self.running.remove(req)
                    self._stop_at_ceiling(req)
                else:
                    self._preempt(req)
                return None
            scheduled.pop(victim.seq_id, None)
            self._preempt(victim)

    def _stop_at_ceiling(self, req: Request) -> None:
        self._finish(req, RequestStatus.FINISHED_LENGTH)
        self._ceiling_outputs.append(self._output(req, [], []))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req.seq_id)
        if req.on_worker:
            self._dropped_seq_ids.append(req.seq_id)
            req.on_worker = False
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        if req.prompt_logprobs is not None and not req.num_samples_ahead:
            # mid-prefill: the prompt is computed again (with a sample in flight, the
            # step that samples it scores the prompt's end: update hands them over)
            req.prompt_logprobs = [None]
        req.num_preemptions += 1
        self._num_preemptions += 1
        bisect.insort(self.waiting, req, key=_order)

    def _schedule_waiting(self, scheduled: dict[int, tuple[Request, int, list[int]]], budget: int) -> set[Request]:
        admitted: set[Request] = set()
        cap = self.config.max_num_seqs
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < cap:
            req = self.waiting[i]
            if req.status is RequestStatus.WAITING_FOR_GRAMMAR or req.results_pending:
                # never blocks the queue: a grammar compiling, or a sequence preempted
                # while its last step ran (resumed once that step's token is in)
                i += 1
                continue
            shared = self._shared_prefix(req)
            if shared is None:  # a child waiting for its sibling 0 to compute the prompt
                i += 1
                continue
            num_computed = len(shared) * self.config.block_size
            n = min(req.num_tokens - num_computed, budget)
            block_ids = self.block_manager.allocate(req.seq_id, shared, num_computed + n)
            if block_ids is None:
                if not self.running and not scheduled:
                    # the whole pool is free and still too small (a resumed child that
                    # had shared its prompt blocks): it can never run again
                    del self.waiting[i]
                    self._stop_at_ceiling(req)
                    continue
                break  # arrival order: nobody overtakes a request that does not fit
            del self.waiting[i]
            req.num_computed_tokens = num_computed
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now = self.clock()
                req.num_cached_tokens = num_computed
                self.metrics.on_first_scheduled(req, now)
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=_order)
            scheduled[req.seq_id] = (req, n, [])
            admitted.add(req)
            budget -= n
        return admitted

    def _shared_prefix(self, req: Request) -> list[int] | None:
        """Blocks req starts with: its sibling 0's prompt blocks, or a prefix-cache hit.

        None while req is a child > 0 whose sibling 0 is still computing the prompt.
        """
        bm = self.block_manager
        if req.index > 0 and req.num_tokens == req.num_prompt_tokens:
            first = self.requests[req.request_id][0]
            if not first.status.finished:
                if first.status != RequestStatus.RUNNING or not first.prompt_computed:
                    return None
                # full prompt blocks, leaving at least one token for the child to compute
                num_full = (req.num_prompt_tokens - 1) // self.config.block_size
                return bm.block_ids(first.seq_id)[:num_full]
        if req.prompt_logprobs is not None:
            return []  # a cache hit would skip prompt positions it must score (as vLLM)
        hits = bm.find_cached_prefix(req.token_ids)
        if req.num_preemptions == 0 and req.index == 0:
            self._prefix_queries += req.num_prompt_tokens
            self._prefix_hits += len(hits) * self.config.block_size
        return hits

    # -- results ---------------------------------------------------------------------
    def update(self, batch: StepBatch, result: StepResult) -> list[EngineOutput]:
        """Apply one executed step; outputs for every sequence that sampled or ended."""
        outputs, self._ceiling_outputs = self._ceiling_outputs, []
        stepped = self._published.pop(batch.step_id, [])
        if len(stepped) != len(batch.scheduled_request_ids):
            raise ValueError(f"step {batch.step_id} is not a step this scheduler published "
                             "and has not applied")
        now = self.clock()
        metrics = self.metrics
        bm = self.block_manager
        block_size = self.config.block_size
        running = RequestStatus.RUNNING
        of_seq: dict[int, Request] = {}
        for req, n in zip(stepped, batch.num_scheduled_tokens):
            req.num_tokens_ahead -= n
            of_seq[req.seq_id] = req
            if req.status is not running:  # aborted, finished or preempted while it ran
                continue
            req.num_computed_tokens += n
            if n > 1 or req.num_computed_tokens % block_size == 0:  # a block may have filled
                bm.cache_full_blocks(req.seq_id, req.token_ids, req.num_computed_tokens)
        for chunk in result.prompt_logprobs:
            req = of_seq.get(chunk.request_id)
            if req is None or req.prompt_logprobs is None:
                continue
            if req.status is running or (req.status is RequestStatus.PREEMPTED
                                         and req.num_samples_ahead):
                req.prompt_logprobs[chunk.start:] = chunk.logprobs
        max_model_len = self.config.max_model_len
        # logprobs may be empty when no sequence of the step asked for them
        all_logprobs = result.logprobs or itertools.repeat(None)
        for seq_id, token, logprobs in zip(result.request_ids, result.sampled_token_ids, all_logprobs):
            req = of_seq.get(seq_id)
            if req is None:
                continue
            req.num_samples_ahead -= 1
            if req.status.finished:  # its token of a step it was scheduled in ahead
                continue
            # a sequence preempted while the step ran keeps its token: the step ran on
            # its blocks before anything else could reuse them
            req.token_ids.append(token)
            metrics.on_token(req, now)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            status = req.check_stop(token, max_model_len)
            if req.grammar is not None:
                status = self._advance_grammar(req, token, status)
            if status is not None:
                (self.running if req.status is running else self.waiting).remove(req)
                self._finish(req, status)
            output = self._output(req, [token], [logprobs])
            if req.prompt_logprobs is not None:  # its first token: the prompt is all scored
                output.prompt_logprobs = self._take_prompt_logprobs(req)
            outputs.append(output)
        metrics.on_step_done()
        return outputs

    @staticmethod
    def _take_prompt_logprobs(req: Request) -> list[TokenLogprobs | None]:
        """Hand over a sequence's prompt logprobs; a resume after preemption does not
        compute them again (and may use prefix-cache hits)."""
        scored, req.prompt_logprobs = req.prompt_logprobs or [], None
        req.sampling_params = msgspec.structs.replace(req.sampling_params, prompt_logprobs=None)
        return scored

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.grammar is not None:
            self._num_grammar_seqs -= 1
        if self.block_manager.holds(req.seq_id):
            self.block_manager.free(req.seq_id)
        if req.on_worker:
            self._dropped_seq_ids.append(req.seq_id)
            req.on_worker = False
        req.status = status
        children = self.requests.get(req.request_id)
        last = children is not None and all(c.status.finished for c in children)
        if last:
            del self.requests[req.request_id]
        self.metrics.on_finished(req, self.clock(), children if last else None)

    def _output(self, req: Request, tokens: list[int], logprobs: list) -> EngineOutput:  # type: ignore[type-arg]
        return EngineOutput(
            request_id=req.request_id, index=req.index, new_token_ids=tokens,
            new_logprobs=logprobs if req.sampling_params.logprobs is not None else [],
            finish_reason=FINISH_REASONS.get(req.status), stop_reason=req.stop_reason,
            num_prompt_tokens=req.num_prompt_tokens, num_cached_tokens=req.num_cached_tokens,
        )

    # -- structured output (services/scheduler/structured_output.py) --------------------
    def _grammar_entry(self, params: SamplingParams) -> GrammarEntry | None:
        so = params.structured_outputs
        if so is None:
            return None
        if self.structured_output is None:
            raise RequestRejected("invalid_request", "structured output is not available here")
        try:
            return self.structured_output.request(so)  # a compile starts off this thread
        except GrammarFailed as e:
            raise RequestRejected("invalid_request", str(e)) from None

    def _await_grammar(self, children: list[Request], entry: GrammarEntry) -> None:
        for child in children:  # each child its own matcher, once the grammar compiled
            child.grammar = SequenceGrammar(entry)
            child.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._compiling += children
        self._num_grammar_seqs += len(children)

    def _poll_grammars(self) -> None:
        """Sequences whose grammar compiled become schedulable; a request whose grammar
        failed (or timed out) ends, its RequestError left for ``take_errors``."""
        assert self.structured_output is not None
        compiling, self._compiling = self._compiling, []
        for req in compiling:
            if req.status is not RequestStatus.WAITING_FOR_GRAMMAR or req.grammar is None:
                continue  # aborted meanwhile, or failed with a sibling
            try:
                ready = self.structured_output.matcher_ready(req.grammar)
            except GrammarFailed as e:
                self.abort_request([req.request_id])  # frees nothing: it never ran
                self._errors.append((req.request_id, "invalid_request", str(e)))
                continue
            if ready:
                req.status = RequestStatus.WAITING
            else:
                self._compiling.append(req)

    def _grammar_bitmasks(self, scheduled: dict[int, tuple[Request, int, list[int]]],
                          order: list[tuple[int, int]], samplers: set[int],
                          ) -> tuple[list[int], bytes]:
        """The masks of the sequences with a grammar that sample this step, in batch order."""
        if not self._num_grammar_seqs:
            return [], b""
        assert self.structured_output is not None
        sampling = [(req.seq_id, req.grammar) for req, _, _ in (scheduled[s] for s, _ in order)
                    if req.grammar is not None and req.seq_id in samplers]
        if not sampling:
            return [], b""
        kept, masks = self.structured_output.fill_bitmasks([g for _, g in sampling])
        return [sampling[i][0] for i in kept], masks

    def _advance_grammar(self, req: Request, token: int, status: RequestStatus | None,
                         ) -> RequestStatus | None:
        """The sampled token through the sequence's matcher: a complete output stops it."""
        assert self.structured_output is not None and req.grammar is not None
        if not self.structured_output.accept(req.grammar, token):
            # the workers sample inside the mask, so this is a bug; end it, not the engine
            log.error("request %s: token %d is outside its grammar; aborted", req.request_id, token)
            return RequestStatus.FINISHED_ABORTED
        if req.grammar.terminated and status is None:
            return RequestStatus.FINISHED_STOPPED
        return status

    def take_errors(self) -> list[tuple[str, str, str]]:
        """(request id, code, message) of the requests that failed since the last call."""
        errors, self._errors = self._errors, []
        return errors

    # -- health ----------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            running=len(self.running), waiting=len(self.waiting), kv_usage=self.block_manager.usage,
            num_kv_blocks=self.config.num_blocks,
            prefix_cache_queries=self._prefix_queries, prefix_cache_hits=self._prefix_hits,
            num_preemptions=self._num_preemptions, invariant_failures=self._invariant_failures,
            block_size=self.config.block_size,
            enable_prefix_caching=self.config.enable_prefix_caching,
            waiting_deferred=sum(r.status is RequestStatus.WAITING_FOR_GRAMMAR
                                 for r in self.waiting),
        )

    def check_invariants(self) -> None:
        """Raise if block accounting or the queues are inconsistent."""
        bm = self.block_manager
        bm.check_invariants()
        live = {r.seq_id for r in self.running}
        if set(bm.seqs) != live:
            raise AssertionError(f"blocks held by {sorted(set(bm.seqs) ^ live)} disagree with running")
        waiting = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR, RequestStatus.PREEMPTED)
        if any(r.status not in waiting for r in self.waiting):
            raise AssertionError("a waiting sequence has a running or finished status")

    def check_invariants_on_idle(self) -> None:
        try:
            self.check_invariants()
        except AssertionError:
            self._invariant_failures += 1
            if self.config.strict_invariants:
                raise


def _order(req: Request) -> tuple[int, int]:
    return req.order_key


def _wrap_i64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x
