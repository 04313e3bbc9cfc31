"""Sample messages of every wire type, ordinary and edge-case, for the codec tests."""

from __future__ import annotations

import math

from shared.protocol import (
    AbortRequest,
    AddRequest,
    ChatMessage,
    EngineOutput,
    EngineOutputs,
    EngineStats,
    GenerateOutput,
    GenerateRequest,
    Heartbeat,
    Histogram,
    MalformedCount,
    NewRequest,
    PromptLogprobs,
    RequestError,
    RunningRequest,
    StepBatch,
    StepResult,
    TokenLogprobs,
    ToolCall,
    ToolFunction,
    WorkerHeartbeat,
    WorkerReady,
)
from shared.sampling_params import SamplingParams

INT32_MAX = 2**31 - 1


def logprobs(k: int = 2) -> TokenLogprobs:
    return TokenLogprobs(logprob=-0.25, rank=1, top_token_ids=list(range(7, 7 + k)),
                         top_logprobs=[-0.25 - i for i in range(k)])


def sampling(**overrides: object) -> SamplingParams:
    values: dict[str, object] = {
        "n": 2, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "min_p": 0.05,
        "presence_penalty": -1.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
        "seed": -(2**63), "stop": ["\n\n", "终"], "stop_token_ids": [2, 0],
        "include_stop_str_in_output": True, "ignore_eos": True, "max_tokens": None,
        "min_tokens": 3, "logprobs": 5,
    }
    values.update(overrides)
    return SamplingParams(**values)  # type: ignore[arg-type]


def step_batch(num_running: int = 3, prompt_len: int = 40) -> StepBatch:
    new = [
        NewRequest(i, list(range(prompt_len)), prompt_len - 2, sampling(),
                   [i, i + 100, INT32_MAX], 16)
        for i in range(2)
    ]
    running = [RunningRequest(10 + i, [i] if i % 2 else []) for i in range(num_running)]
    ids = [r.request_id for r in new] + [r.request_id for r in running]
    return StepBatch(7, new, running, ids, [prompt_len - 16] * 2 + [1] * num_running,
                     [2**63 - 1, 7])


def samples() -> list[object]:
    """One or more instances of every top-level message type, edge cases included."""
    return [
        AddRequest("req-1", [1, 2, 3], SamplingParams(), 1700000000.25),
        AddRequest("ключ-🔑-標識", [], sampling(temperature=0, seed=None), 0.0, priority=-5),
        AddRequest("long", list(range(100_000)), SamplingParams(max_tokens=1), 1.0),
        AddRequest("max-id", [INT32_MAX, 0], SamplingParams(temperature=2), 1.0),
        AbortRequest([]),
        AbortRequest(["a", "б", ""]),
        AbortRequest(["a"], index=3),
        EngineOutputs([]),
        EngineOutputs([
            EngineOutput("r", 0, [5, 6], [logprobs(), None]),
            EngineOutput("r", 1, [], [], "stop", 2, 12, 8),
            EngineOutput("s", 0, [9], [TokenLogprobs(-math.inf, 50_000, [], [])], "length"),
            EngineOutput("p", 0, [4], [], None, None, 3, 0, [None, logprobs(1), logprobs(0)]),
        ]),
        RequestError("req-1", "too_long", "prompt is 9000 tokens; max_model_len is 8192 ✗"),
        StepBatch(0),
        step_batch(),
        StepResult(0),
        StepResult(3, [1, 0], [11, 0], [None, logprobs(20)]),
        StepResult(4, [5], [11]),  # logprobs omitted entirely
        StepResult(5, [], [], [], [PromptLogprobs(2, 1, [logprobs(0), logprobs(3)]),
                                   PromptLogprobs(0, 17, [])]),  # prompt chunks, nothing sampled
        WorkerReady(rank=0, num_kv_blocks=4096, block_size=16, max_model_len=8192,
                    vocab_size=49152, eos_token_ids=[0, 2]),
        GenerateRequest("c-1", SamplingParams(), prompt="你好 👋"),
        GenerateRequest("c-4", SamplingParams(prompt_logprobs=20, logit_bias={0: -100.0,
                                                                               INT32_MAX: 100}),
                        prompt="bias"),
        GenerateRequest("c-2", sampling(), prompt_token_ids=[], stream=False),
        GenerateRequest("c-3", SamplingParams(logprobs=0), messages=[
            ChatMessage("system", ""), ChatMessage("user", "emoji 🦀 and 中文")],
            add_generation_prompt=False),
        GenerateRequest("c-5", SamplingParams(), messages=[
            ChatMessage("user", "weather?"),
            ChatMessage("assistant", None, [ToolCall(0, "call_1", "get_weather", '{"city": "Pa"}')]),
            ChatMessage("tool", "18 C", tool_call_id="call_1")],
            tools=[ToolFunction("get_weather", "the weather", {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 20}}}), ToolFunction("noop")],
            tool_choice="function", tool_function="noop", parallel_tool_calls=False),
        GenerateOutput("c-1", 0, "", []),
        GenerateOutput("c-5", 0, "ok", [5], tool_calls=[ToolCall(0, "call_2", "noop", "{"),
                                                       ToolCall(1, arguments="}")]),
        GenerateOutput("c-4", 0, "x", [3], [], None, None, 2, 1, 0, [9, 3], [None, logprobs()]),
        GenerateOutput("c-1", 1, "👋 终", [9, INT32_MAX], [logprobs(), None], "stop", "终",
                       4, 2, 1),
        WorkerReady(rank=3, num_kv_blocks=2, block_size=1, max_model_len=1, vocab_size=1,
                    eos_token_ids=[]),
        Heartbeat("frontend-0-host-1"),
        WorkerHeartbeat(0),
        WorkerHeartbeat(7),
        EngineStats(0, 0, 0.0, 1, 0, 0, 0, 0, 0, 0, 0, 0, *[Histogram([], [0], 0.0, 0)] * 4, 0),
        EngineStats(3, 2, 0.25, 100, 50, 32, 1, 10, 20, 1, 2, 3,
                    Histogram([0.01, 0.1, 1.0], [1, 2, 3, 4], 5.5, 10), Histogram([1.0], [0, 1], 2.0, 1),
                    Histogram([1.0], [1, 0], 0.5, 1), Histogram([0.5], [0, 0], 0.0, 0), 0,
                    [MalformedCount("scheduler_frontend", "msgpack", 4)]),
        # the fields appended for vLLM's metric names
        EngineStats(1, 4, 0.5, 64, 10, 4, 2, 9, 7, 1, 1, 0,
                    *[Histogram([0.1], [1, 0], 0.05, 1)] * 4, 0, [],
                    "Qwen/Qwen2.5-0.5B", "auto", 16, True, 3, 90, 40,
                    *[Histogram([1.0, 2.0, 5.0], [0, 1, 0, 2], 13.5, 3)] * 11, 12, 2**40),
    ]
