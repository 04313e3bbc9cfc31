"""The in-process engine core: the scheduler and one model runner, no sockets.

The same step the pipeline runs across processes (schedule -> StepBatch ->
worker -> StepResult -> update), in one loop, for the offline ``LLM`` and tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from services.worker.runner_builder import RunnerSpec, build_runner
from shared.protocol import RequestOutput, StepBatch
from shared.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    strict_invariants: bool = False


class EngineCore:
    def __init__(self, model_dir: Path, config: EngineConfig) -> None:
        self.config = config
        built = build_runner(model_dir, RunnerSpec(
            block_size=config.block_size, kv_cache_bytes=config.kv_cache_bytes,
            num_kv_blocks=config.num_kv_blocks, max_model_len=config.max_model_len,
            dtype=config.dtype, device=config.device,
        ))
        self.runner = built.runner
        self.model_config = built.model_config
        self.max_model_len = built.max_model_len
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=built.num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=built.max_model_len,
                vocab_size=built.model_config.vocab_size,
                enable_prefix_caching=config.enable_prefix_caching,
                eos_token_ids=tuple(built.model_config.eos_token_ids),
                strict_invariants=config.strict_invariants,
            )
        )
        self.step_trace: list[StepBatch] | None = None  # tests switch it on

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.scheduler.add_request(request_id, prompt_token_ids, params)

    def abort_request(self, request_ids: list[str], index: int | None = None) -> list[RequestOutput]:
        return self.scheduler.abort_request(request_ids, index)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        if self.step_trace is not None:
            self.step_trace.append(batch)
        result = self.runner.execute(batch)
        return self.scheduler.update(batch, result)

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()
