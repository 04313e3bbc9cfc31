"""A minimal stand-in for the scheduler that drives a ModelRunner in tests.

It hands out KV blocks in shuffled order (so block tables are non-contiguous)
and builds StepBatch deltas exactly as the protocol describes: compact int sequence
ids on the wire, one-token sequences first. Tests name requests with strings; results
and logits come back under those names.
"""

from __future__ import annotations

import random

import torch

from services.worker.model_runner import ModelRunner
from shared.protocol import NewRequest, RunningRequest, StepBatch, StepResult
from shared.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=None)


class PagedDriver:
    def __init__(self, runner: ModelRunner, seed: int = 0, keep_logits: bool = True) -> None:
        """``keep_logits`` False: steps run as a worker runs them (``execute``), and return
        no logits."""
        self.runner = runner
        self.keep_logits = keep_logits
        self.free = list(range(runner.num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tokens: dict[str, list[int]] = {}
        self.num_prompt: dict[str, int] = {}
        self.params: dict[str, SamplingParams] = {}
        self.computed: dict[str, int] = {}
        self.blocks: dict[str, list[int]] = {}
        self.on_worker: set[str] = set()
        self.seq_ids: dict[str, int] = {}
        self.step_id = 0

    def add(self, request_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> None:
        self.tokens[request_id] = list(prompt)
        self.num_prompt[request_id] = len(prompt)
        self.params[request_id] = params
        self.computed[request_id] = 0
        self.blocks[request_id] = []
        self.seq_ids[request_id] = len(self.seq_ids)

    def step(self, num_tokens: dict[str, int]) -> tuple[StepResult, dict[str, torch.Tensor]]:
        batch = StepBatch(step_id=self.step_id)
        self.step_id += 1
        bs = self.runner.block_size
        # the scheduler's order: one-token sequences first (stable otherwise)
        ordered = sorted(num_tokens.items(), key=lambda item: item[1] > 1)
        for rid, n in ordered:
            sid = self.seq_ids[rid]
            needed = -(-(self.computed[rid] + n) // bs) - len(self.blocks[rid])
            new_blocks = [self.free.pop() for _ in range(max(0, needed))]
            self.blocks[rid].extend(new_blocks)
            if rid in self.on_worker:
                batch.running_requests.append(RunningRequest(sid, new_blocks))
            else:
                batch.new_requests.append(
                    NewRequest(sid, list(self.tokens[rid]), self.num_prompt[rid], self.params[rid],
                               list(self.blocks[rid]), self.computed[rid])
                )
                self.on_worker.add(rid)
            batch.scheduled_request_ids.append(sid)
            batch.num_scheduled_tokens.append(n)
        if self.keep_logits:
            result, logits = self.runner.execute_with_logits(batch)
        else:
            result, logits = self.runner.execute(batch), {}
        for rid, n in num_tokens.items():
            self.computed[rid] += n
        name = {sid: rid for rid, sid in self.seq_ids.items()}
        names = [name[sid] for sid in result.request_ids]
        for rid, token in zip(names, result.sampled_token_ids):
            self.tokens[rid].append(token)
        named = StepResult(result.step_id, names, result.sampled_token_ids,  # type: ignore[arg-type]
                           result.logprobs)
        return named, {name[sid]: row for sid, row in logits.items()}

    def prefill(self, request_ids: list[str]) -> tuple[StepResult, dict[str, torch.Tensor]]:
        return self.step({r: len(self.tokens[r]) - self.computed[r] for r in request_ids})

    def decode(self, request_ids: list[str]) -> tuple[StepResult, dict[str, torch.Tensor]]:
        return self.step({r: 1 for r in request_ids})

    def output(self, request_id: str) -> list[int]:
        return self.tokens[request_id][self.num_prompt[request_id]:]
