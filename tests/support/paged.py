"""A minimal stand-in for the scheduler that drives a ModelRunner in tests.

It hands out KV blocks in shuffled order (so block tables are non-contiguous)
and builds StepBatch deltas exactly as the protocol describes.
"""

from __future__ import annotations

import random

import torch

from services.worker.model_runner import ModelRunner
from shared.protocol import NewRequest, RunningRequest, StepBatch, StepResult
from shared.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class PagedDriver:
    def __init__(self, runner: ModelRunner, seed: int = 0) -> None:
        self.runner = runner
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tokens: dict[str, list[int]] = {}
        self.num_prompt: dict[str, int] = {}
        self.params: dict[str, SamplingParams] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.on_worker: set[str] = set()
        self.step_id = 0

    def add(self, request_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> None:
        self.tokens[request_id] = list(prompt)
        self.num_prompt[request_id] = len(prompt)
        self.params[request_id] = params
        self.computed[request_id] = 0
        self.blocks[request_id] = []

    def step(self, num_tokens: dict[str, int]) -> tuple[StepResult, dict[str, torch.Tensor]]:
        batch = StepBatch(step_id=self.step_id)
        self.step_id += 1
        bs = self.runner.block_size
        for rid, n in num_tokens.items():
            needed = -(-(self.computed[rid] + n) // bs) - len(self.blocks[rid])
            new_blocks = [self.free.pop() for _ in range(max(0, needed))]
            self.blocks[rid].extend(new_blocks)
            if rid in self.on_worker:
                batch.running_requests.append(RunningRequest(rid, new_blocks))
            else:
                batch.new_requests.append(
                    NewRequest(rid, list(self.tokens[rid]), self.num_prompt[rid], self.params[rid],
                               list(self.blocks[rid]), self.computed[rid])
                )
                self.on_worker.add(rid)
            batch.scheduled_request_ids.append(rid)
            batch.num_scheduled_tokens.append(n)
        result, logits = self.runner.execute_with_logits(batch)
        for rid, n in num_tokens.items():
            self.computed[rid] += n
        for rid, token in zip(result.request_ids, result.sampled_token_ids):
            self.tokens[rid].append(token)
        return result, logits

    def prefill(self, request_ids: list[str]) -> tuple[StepResult, dict[str, torch.Tensor]]:
        return self.step({r: len(self.tokens[r]) - self.computed[r] for r in request_ids})

    def decode(self, request_ids: list[str]) -> tuple[StepResult, dict[str, torch.Tensor]]:
        return self.step({r: 1 for r in request_ids})

    def output(self, request_id: str) -> list[int]:
        return self.tokens[request_id][self.num_prompt[request_id]:]
