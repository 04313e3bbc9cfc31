"""The scheduler's view of one sequence: its tokens, progress, status and stop rules.

A request with ``n > 1`` becomes ``n`` sequences (children) sharing the parent's
``request_id`` with ``index`` 0..n-1; each child is scheduled on its own and is
known to the workers by ``seq_id``, a small int the scheduler mints (the worker link
never carries the frontends' request ids). Child 0 computes the prompt; the others
start once it has, sharing its full prompt blocks (see ``Scheduler``).

Each sequence carries its own timestamps (wall-clock seconds, ``time.time()``, since
the arrival time is stamped by the frontend's process): the latency histograms of
``services/scheduler/metrics.py`` are observed from them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.protocol import TokenLogprobs
from shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.scheduler.structured_output import SequenceGrammar


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # in the waiting queue, its structured-output grammar still compiling: schedule() skips
    # it (vLLM's WAITING_FOR_FSM)
    WAITING_FOR_GRAMMAR = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # finished states sort after PREEMPTED
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    request_id: str
    index: int
    # prompt followed by every output token so far (one list: no per-step concatenation)
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # (priority, arrival number): lower runs first and is preempted last
    order_key: tuple[int, int]
    max_tokens: int  # resolved: params.max_tokens, or what max_model_len leaves
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) and stop_token_ids
    seq_id: int = -1  # minted by the scheduler when the sequence is created
    arrival_time: float = 0.0  # stamped by the frontend
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    on_worker: bool = False  # the workers hold its state (sent as a NewRequest)
    stop_reason: int | None = None
    num_preemptions: int = 0
    # async scheduling: what steps published but not yet applied by ``update`` hold of
    # this sequence, the tokens they compute and the tokens they sample (see Scheduler)
    num_tokens_ahead: int = 0
    num_samples_ahead: int = 0
    # structured output: its compiled grammar and matcher (services/scheduler/structured_output.py)
    grammar: SequenceGrammar | None = None
    # prompt_logprobs asked and not delivered yet: [None] + what the steps computed so
    # far (index = prompt position); None otherwise (children > 0, or once delivered)
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_known_tokens(self) -> int:
        """Its tokens once the steps in flight have sampled theirs."""
        return len(self.token_ids) + self.num_samples_ahead

    @property
    def num_computed_ahead(self) -> int:
        """Its computed tokens once the steps in flight have run."""
        return self.num_computed_tokens + self.num_tokens_ahead

    @property
    def results_pending(self) -> bool:
        return bool(self.num_tokens_ahead or self.num_samples_ahead)

    @property
    def prompt_computed(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def check_stop(self, token: int, max_model_len: int) -> RequestStatus | None:
        """The finished status the just-appended token leads to, or None to go on."""
        num_out = self.num_output_tokens
        if token in self.stop_ids and num_out > self.sampling_params.min_tokens:
            if token in self.sampling_params.stop_token_ids:
                self.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if num_out >= self.max_tokens or len(self.token_ids) >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
