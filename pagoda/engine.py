"""The in-process engine core: the scheduler and one model runner, no sockets.

The same step the pipeline runs across processes (schedule -> StepBatch ->
worker -> StepResult -> update), in one loop, for the offline ``LLM`` and tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerStats
from services.worker.attention import get_attention_backend
from services.worker.loader import load_model
from services.worker.model_runner import ModelRunner, kv_cache_bytes_per_block
from shared.protocol import RequestOutput, StepBatch
from shared.sampling_params import SamplingParams

DEFAULT_KV_CACHE_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    kv_cache_bytes: int | None = None
    num_kv_blocks: int | None = None
    max_model_len: int | None = None
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    strict_invariants: bool = False


class EngineCore:
    def __init__(self, model_dir: Path, config: EngineConfig) -> None:
        self.config = config
        model_len = config.max_model_len
        model = load_model(model_dir, config.dtype, config.device, max_position=None)
        max_pos = model.config.max_position_embeddings
        self.max_model_len = model_len or max_pos
        if self.max_model_len > max_pos:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {max_pos}"
            )
        num_blocks = self._num_blocks(model, config)
        backend = get_attention_backend(torch.device(config.device))
        self.runner = ModelRunner(model, backend, num_blocks, config.block_size, config.dtype,
                                  config.device)
        self.model_config = model.config
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                vocab_size=model.config.vocab_size,
                enable_prefix_caching=config.enable_prefix_caching,
                eos_token_ids=tuple(model.config.eos_token_ids),
                strict_invariants=config.strict_invariants,
            )
        )
        self.step_trace: list[StepBatch] | None = None  # tests switch it on

    @staticmethod
    def _num_blocks(model, config: EngineConfig) -> int:  # type: ignore[no-untyped-def]
        if config.num_kv_blocks is not None:
            if config.num_kv_blocks < 2:
                raise ValueError(f"num_kv_blocks must be >= 2, got {config.num_kv_blocks}")
            return config.num_kv_blocks
        per_block = kv_cache_bytes_per_block(model, config.block_size, config.dtype)
        budget = config.kv_cache_bytes if config.kv_cache_bytes is not None else DEFAULT_KV_CACHE_BYTES
        num_blocks = budget // per_block
        if num_blocks < 2:
            raise ValueError(f"kv_cache_bytes {budget} holds fewer than 2 blocks of {per_block} bytes")
        return int(num_blocks)

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
