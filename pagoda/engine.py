"""The in-process engine core: the scheduler and one model runner, no sockets.

The same step the pipeline runs across processes (schedule -> StepBatch ->
worker -> StepResult -> update), in one loop, for the offline ``LLM`` and tests. With
``tensor_parallel_size`` M > 1 the caller's process is rank 0 and ranks 1..M-1 are child
processes that receive each step from it (``services/worker/step_relay.py``).
Structured output runs the scheduler's ``StructuredOutputManager`` too; ``add_request``
waits for the request's grammar to compile (the scheduler process never does), so an
unusable constraint is a ValueError there and a step never finds one compiling.

With ``async_scheduling`` (the default) each ``step`` schedules and runs step N+1
before it applies step N's result, the order the scheduler process keeps with its
workers: the same scheduler code runs, so ``pagoda.LLM`` and the tests exercise it, and
the tokens are the same either way. Outputs then come one call later; an abort between
two calls lands while a step is out, as it does in the pipeline.
"""

from __future__ import annotations

import time
from pathlib import Path

from services.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from services.scheduler.structured_output import GrammarFailed, StructuredOutputManager
from services.worker.parallel import CollectiveTimer
from services.worker.runner_builder import RunnerSpec, build_runner
from services.worker.step_relay import TensorParallelGroup, check_split
from shared.config import EngineSettings
from shared.protocol import EngineOutput, StepBatch, StepResult
from shared.sampling_params import SamplingParams


class EngineCore:
    """``settings``: the engine settings every process builds from (shared/config.py);
    ``strict_invariants``: a broken block-accounting invariant raises (tests)."""

    def __init__(self, model_dir: Path, settings: EngineSettings, *,
                 strict_invariants: bool = False) -> None:
        self.settings = settings
        spec = RunnerSpec.from_settings(settings)
        if settings.tensor_parallel_size > 1:  # before any rank starts: sizes that do not split
            check_split(model_dir, settings.tensor_parallel_size)
        self._group = TensorParallelGroup.start(model_dir, spec, settings.tensor_parallel_size)
        try:
            built = build_runner(model_dir, spec, self._group.tp)
        except BaseException:
            self._group.stop()
            raise
        self.runner = built.runner
        self.model_config = built.model_config
        self.max_model_len = built.max_model_len
        vocab_size, eos_ids = built.model_config.vocab_size, built.model_config.eos_token_ids
        self.structured_output = StructuredOutputManager(
            model_dir, vocab_size, eos_ids, compile_timeout_s=settings.grammar_compile_timeout_s,
            cache_size=settings.grammar_cache_size)
        self.scheduler = Scheduler(SchedulerConfig.from_settings(
            settings, num_blocks=built.num_blocks, max_model_len=built.max_model_len,
            vocab_size=vocab_size, eos_token_ids=eos_ids, strict_invariants=strict_invariants,
        ), structured_output=self.structured_output)
        # tests and pagoda bench --roofline switch it on: each batch run and the seconds
        # its execute took
        self.step_log: list[tuple[StepBatch, float]] | None = None
        self.async_scheduling = settings.async_scheduling
        # async scheduling: the step run ahead of its update, and its result
        self._ahead: tuple[StepBatch, StepResult] | None = None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if params.structured_outputs is not None:
            try:  # compiled (and cached) before the scheduler sees the request
                self.structured_output.wait(self.structured_output.request(params.structured_outputs))
            except GrammarFailed as e:
                raise ValueError(str(e)) from None
        self.scheduler.add_request(request_id, prompt_token_ids, params)

    def abort_request(self, request_ids: list[str], index: int | None = None) -> list[EngineOutput]:
        return self.scheduler.abort_request(request_ids, index)

    def has_unfinished_requests(self) -> bool:
        return self._ahead is not None or self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineOutput]:
        if not self.async_scheduling:
            batch = self._schedule()
            return self.scheduler.update(batch, self._run(batch))
        if self._ahead is None:
            first = self._schedule()
            self._ahead = (first, self._run(first))
        batch, result = self._ahead
        self._ahead = None
        if self.scheduler.has_unfinished_requests() and not self.scheduler.waits_for_results():
            ahead = self._schedule()
            # nothing to run ahead (every sequence waits for this result): not sent
            if ahead.scheduled_request_ids or ahead.finished_request_ids:
                self._ahead = (ahead, self._run(ahead))
        return self.scheduler.update(batch, result)

    def _schedule(self) -> StepBatch:
        batch = self.scheduler.schedule()
        errors = self.scheduler.take_errors()
        if errors:  # not expected: add_request compiled every grammar
            raise RuntimeError("; ".join(f"request {rid}: {msg}" for rid, _, msg in errors))
        return batch

    def _run(self, batch: StepBatch) -> StepResult:
        self._group.relay_step(batch)
        if self.step_log is None:
            return self.runner.execute(batch)
        started = time.perf_counter()
        result = self.runner.execute(batch)
        self.step_log.append((batch, time.perf_counter() - started))
        return result

    def collective_timer(self) -> CollectiveTimer | None:
        """Rank 0's time in collectives (None with one rank)."""
        return self._group.tp.timer

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing with one rank); idempotent."""
        self._group.stop()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()
