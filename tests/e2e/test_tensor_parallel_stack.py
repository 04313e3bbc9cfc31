"""`pagoda serve --tensor-parallel-size 2` (issue 15): two worker ranks, one model.

The stack's greedy tokens under concurrent traffic (shared prefixes, chunked prefill and
preemption in play) equal the offline single-rank engine's; a rank other than 0 killed
mid-decode fails the request in flight with ``engine_error`` within seconds and takes
the stack down, nothing left.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pagoda import LLM
from shared.sampling_params import SamplingParams
from support.live_stack import (
    assert_stream_failed,
    kill_if_running,
    left_running,
    serving,
    start_stack,
)

pytestmark = pytest.mark.slow
PREFIX = "Once upon a time, in a land of rivers and hills, there lived"
PROMPTS = [f"{PREFIX} a {animal}" for animal in ("fox", "crow", "bear", "wolf", "hare", "owl")] + [
    "Count: one, two, three,", "The capital of France is"]
STACK_ARGS = ("--tensor-parallel-size", "2", "--num-kv-blocks", "24", "--block-size", "8",
              "--max-num-batched-tokens", "32", "--max-model-len", "512")


def test_two_ranks_serve_the_tokens_of_one(tiny_smollm_dir: Path, tmp_path: Path) -> None:
    with LLM(str(tiny_smollm_dir), dtype="float32", device="cpu", num_kv_blocks=256) as llm:
        expected = [o.outputs[0].text for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
            use_tqdm=False)]
    with serving(tiny_smollm_dir, tmp_path / "serve.log", 1, *STACK_ARGS) as stack:
        def complete(prompt: str) -> str:
            r = httpx.post(f"{stack.http}/completions", timeout=300, json={
                "model": str(tiny_smollm_dir), "prompt": prompt, "max_tokens": 32,
                "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return str(r.json()["choices"][0]["text"])

        with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all at once: the pool runs short
            got = list(pool.map(complete, PROMPTS))
        log = stack.log()
    assert got == expected
    preemptions = [int(n) for n in re.findall(r"preemptions=(\d+)", log)]
    assert preemptions and max(preemptions) > 0, "the KV pool was meant to run short"


def test_a_killed_rank_fails_requests_fast(tiny_smollm_dir: Path, tmp_path: Path) -> None:
    stack = start_stack(tiny_smollm_dir, tmp_path / "serve.log", 1, *STACK_ARGS)
    try:
        async def run() -> tuple[list[str], float]:
            async with httpx.AsyncClient(base_url=stack.http, timeout=120) as http, \
                    http.stream("POST", "/completions", json={
                        "model": str(tiny_smollm_dir), "prompt": PROMPTS[0], "max_tokens": 400,
                        "ignore_eos": True, "temperature": 0, "stream": True}) as r:
                lines = r.aiter_lines()
                assert (await lines.__anext__()).startswith("data: {")
                killed = time.monotonic()
                os.kill(stack.pids["worker-1"], signal.SIGKILL)
                events = [line async for line in lines if line]
                return events, time.monotonic() - killed

        events, waited = asyncio.run(run())
        code = stack.proc.wait(timeout=90)
    finally:
        kill_if_running(stack)
    assert_stream_failed(events)
    assert waited < 10, waited
    assert code == 1
    assert left_running(stack, wait_s=30) == []


def test_serve_refuses_a_size_the_model_cannot_split(smollm2_dir: Path) -> None:
    """SmolLM2 has 9 heads and 3 KV heads: 2 ranks are refused before any process starts."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "pagoda.cli", "serve", "--model", str(smollm2_dir),
                          "--tensor-parallel-size", "2"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "tensor_parallel_size 2 does not split 9 attention heads, 3 KV heads" in run.stderr
