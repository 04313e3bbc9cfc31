"""Async scheduling in the offline engine (pagoda/engine.py), on tiny random models: step
N+1 is scheduled and run before step N's update, and every request gets the same
tokens, logprobs and finish reasons as with one step at a time, through stop tokens,
stop strings, max_tokens, min_tokens, n > 1, seeded sampling, prompt logprobs, chunked
prefill, preemption in a small KV pool, grammars, and aborts that land mid-overlap."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from pagoda import LLM, SamplingParams
from pagoda.engine import EngineCore
from shared.config import EngineSettings
from shared.sampling_params import StructuredOutputsParams
from support.checkpoints import make_checkpoint


@pytest.fixture(autouse=True)
def _testing_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_TESTING", "1")  # a broken block invariant raises


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("async-tiny"), "llama", seed=11,
                           max_position_embeddings=1024)


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(3, 90))] for _ in range(count)]


def outcome(outputs: list[Any]) -> list[Any]:
    return [[(s.token_ids, s.finish_reason, s.stop_reason, s.logprobs) for s in o.outputs]
            + [o.prompt_logprobs] for o in outputs]


def generate(model_dir: Path, ps: list[list[int]], params: list[SamplingParams],
             **settings: Any) -> tuple[list[Any], LLM]:
    llm = LLM(str(model_dir), dtype="float32", **settings)
    return llm.generate(ps, params, use_tqdm=False), llm


def test_mixed_workload_same_outputs_with_and_without(model_dir: Path) -> None:
    ps = prompts(12, seed=1)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    # stop ids that really come up: a token of each prompt's greedy continuation
    reference, _ = generate(model_dir, ps, [greedy] * len(ps), num_kv_blocks=400)
    params = []
    for i, out in enumerate(reference):
        toks = out.outputs[0].token_ids
        kind = i % 6
        if kind == 0:
            params.append(SamplingParams(temperature=0.0, max_tokens=20,
                                         stop_token_ids=[toks[5]], ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(temperature=0.0, max_tokens=1 + i, ignore_eos=True))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.9, seed=7 + i, n=2, max_tokens=16,
                                         logprobs=2, ignore_eos=True))
        elif kind == 3:
            params.append(SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=1,
                                         ignore_eos=True))
        elif kind == 4:
            params.append(SamplingParams(temperature=0.0, max_tokens=20, min_tokens=8,
                                         stop_token_ids=[toks[2]], ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0.7, top_k=20, seed=i, max_tokens=18,
                                         repetition_penalty=1.3, ignore_eos=True))
    # a pool of 24 blocks of 16 tokens, 64 tokens a step: chunks and preemptions
    small = {"num_kv_blocks": 24, "max_num_batched_tokens": 64}
    want, sync_llm = generate(model_dir, ps, params, async_scheduling=False, **small)
    got, async_llm = generate(model_dir, ps, params, async_scheduling=True, **small)
    assert outcome(got) == outcome(want)
    assert async_llm.stats().num_preemptions > 0, "the workload should preempt"
    stops = [o.outputs[0].finish_reason for o in got]
    assert "stop" in stops and "length" in stops
    for llm in (sync_llm, async_llm):
        assert llm.stats().kv_usage == 0.0 and llm.stats().running == 0


def test_stop_strings_and_a_grammar_same_text(tiny_smollm_dir: Path) -> None:
    so = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]})
    params = [SamplingParams(temperature=0.8, seed=3, max_tokens=24, structured_outputs=so),
              SamplingParams(temperature=0.0, max_tokens=30, stop=["e"], ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)]
    texts = ["Hello there", "The weather is", "A list of numbers:"]
    runs = []
    for flag in (False, True):
        llm = LLM(str(tiny_smollm_dir), dtype="float32", num_kv_blocks=128,
                  max_model_len=256, async_scheduling=flag)
        runs.append([(o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason)
                     for o in llm.generate(texts, params, use_tqdm=False)])
    assert runs[0] == runs[1]


def test_an_abort_mid_overlap_leaves_the_others_alone(model_dir: Path) -> None:
    ps = prompts(6, seed=3)
    p = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def run(async_scheduling: bool, abort_at: int | None) -> dict[str, list[int]]:
        settings = EngineSettings(model=str(model_dir), dtype="float32", num_kv_blocks=64,
                                  async_scheduling=async_scheduling)
        core = EngineCore(model_dir, settings, strict_invariants=True)
        for i, prompt in enumerate(ps):
            core.add_request(f"r{i}", prompt, p)
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(ps))}
        finish: dict[str, str | None] = {}
        n = 0
        while core.has_unfinished_requests():
            if n == abort_at:
                assert core._ahead is not None  # a step is out: the abort lands mid-overlap
                for out in core.abort_request(["r2"]):
                    finish[out.request_id] = out.finish_reason
            for out in core.step():
                got[out.request_id] += out.new_token_ids
                if out.finish_reason is not None:
                    finish[out.request_id] = out.finish_reason
            n += 1
        st = core.stats()
        assert (st.running, st.waiting, st.kv_usage) == (0, 0, 0.0)
        assert finish["r2"] == ("abort" if abort_at is not None else "length")
        return got

    want = run(False, None)
    got = run(True, 6)
    assert 0 < len(got["r2"]) < 16 and got["r2"] == want["r2"][: len(got["r2"])]
    assert {k: v for k, v in got.items() if k != "r2"} == {
        k: v for k, v in want.items() if k != "r2"}


def test_a_grammar_sequence_samples_every_step(tiny_smollm_dir: Path) -> None:
    # its next mask needs the token in flight: beside a free-running sequence the engine
    # waits for it instead of running ahead, so it samples every step, as without async
    # scheduling, not every other one
    so = StructuredOutputsParams(json={"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]})
    params = [SamplingParams(temperature=0.8, seed=5, max_tokens=24, structured_outputs=so),
              SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)]
    runs = []
    for flag in (False, True):
        llm = LLM(str(tiny_smollm_dir), dtype="float32", num_kv_blocks=64, max_model_len=256,
                  async_scheduling=flag)
        llm.engine.step_log = []
        outs = llm.generate(["Hello", "A story:"], params, use_tqdm=False)
        trace = [batch for batch, _ in llm.engine.step_log]
        grammar_seq = trace[0].new_requests[0].request_id  # submitted first
        steps = [i for i, b in enumerate(trace) if grammar_seq in b.scheduled_request_ids]
        runs.append((outs[0].outputs[0].token_ids, steps[-1] - steps[0] + 1))
    (sync_tokens, sync_span), (async_tokens, async_span) = runs
    assert async_tokens == sync_tokens and len(sync_tokens) > 3
    assert async_span == sync_span == len(sync_tokens)
