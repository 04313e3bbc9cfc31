"""A stand-in for the ``vllm`` package, for testing ``pagoda/bench/vllm_runner.py``'s
protocol where vLLM is not installed (CI): the runner and ``baseline_vllm``'s session are
the real ones, only the engine under them is this. Put this folder on PYTHONPATH.

Each output token is the prompt's first token (so a test can tell which prompts a pass
ran); every ``generate`` call appends its prompts' first tokens as a JSON line to
``$FAKE_VLLM_LOG`` if set; ``$FAKE_VLLM_EXIT_AT=n`` makes the n-th call exit the process
with status 3 (a runner that dies mid-round).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    ignore_eos: bool = False
    detokenize: bool = True


@dataclass
class _Completion:
    token_ids: list[int] = field(default_factory=list)


@dataclass
class _Output:
    outputs: list[_Completion]


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.model, self.kwargs, self.calls = model, kwargs, 0

    def generate(self, prompts: list[dict[str, list[int]]], params: list[SamplingParams],
                 use_tqdm: bool = True) -> list[_Output]:
        self.calls += 1
        if os.environ.get("FAKE_VLLM_EXIT_AT") == str(self.calls):
            os._exit(3)
        firsts = [p["prompt_token_ids"][0] for p in prompts]
        if log := os.environ.get("FAKE_VLLM_LOG"):
            with open(log, "a", encoding="utf-8") as f:
                f.write(json.dumps(firsts) + "\n")
        return [_Output([_Completion([first] * sp.max_tokens)])
                for first, sp in zip(firsts, params)]
