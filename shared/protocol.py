"""Every message that crosses a process boundary, declared once.

Links (who sends what to whom):
- frontend -> scheduler: ``AddRequest``, ``AbortRequest``;
- scheduler -> frontend: ``RequestOutputs`` (one batch per step per frontend),
  ``RequestError`` (a typed rejection of one request);
- scheduler -> workers: ``StepBatch``; worker rank 0 -> scheduler: ``StepResult``;
- worker -> scheduler at start-up: ``WorkerReady`` (the KV capacity handshake).

The worker link, one step of the continuous batch:

``StepBatch`` is a delta, as in vLLM v1: a request's tokens, sampling params and
block table travel once, when it is first scheduled or resumed after preemption
(``new_requests``); later steps carry only its newly appended blocks
(``running_requests``). ``finished_request_ids`` tells workers to drop the state of
requests that finished, were aborted or were preempted (a preempted request comes
back later as a new request with all its tokens).

The order of ``scheduled_request_ids`` is the order of the flattened token batch;
``StepResult`` lists, in that order, the requests that sampled a token this step
(a request in the middle of a chunked prefill samples nothing).

The ZMQ codec for these types lives in ``shared/codec.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.sampling_params import SamplingParams


@dataclass
class NewRequest:
    """A request the workers have no state for: sent in full, once."""

    request_id: str
    # prompt tokens followed by any output tokens generated before a preemption
    token_ids: list[int]
    # token_ids[:num_prompt_tokens] is the prompt (penalties tell prompt from output)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    # physical KV block ids, in logical order; covers at least the tokens of this step
    block_ids: list[int]
    # tokens whose K/V are already in the cache (prefix-cache hit); computing starts here
    num_computed_tokens: int

    def __repr__(self) -> str:  # token ids are long and may be private
        return (
            f"NewRequest(id={self.request_id!r}, tokens={len(self.token_ids)}, "
            f"prompt={self.num_prompt_tokens}, blocks={len(self.block_ids)}, "
            f"computed={self.num_computed_tokens})"
        )


@dataclass
class RunningRequest:
    """A request the workers already hold: only what changed since last step."""

    request_id: str
    # blocks appended to the end of its block table since its last step
    new_block_ids: list[int] = field(default_factory=list)


@dataclass
class StepBatch:
    step_id: int
    new_requests: list[NewRequest] = field(default_factory=list)
    running_requests: list[RunningRequest] = field(default_factory=list)
    # request_id of every request computed this step, in batch order
    scheduled_request_ids: list[str] = field(default_factory=list)
    # scheduled_request_ids[i] -> number of tokens it computes this step (>= 1)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    # requests whose worker state is dropped before this step runs
    finished_request_ids: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def __repr__(self) -> str:
        return (
            f"StepBatch(step={self.step_id}, new={len(self.new_requests)}, "
            f"running={len(self.running_requests)}, tokens={self.total_num_scheduled_tokens}, "
            f"finished={len(self.finished_request_ids)})"
        )


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token, from the raw model distribution."""

    logprob: float  # of the sampled token
    rank: int  # 1 = the most likely token
    top_token_ids: list[int]  # the top-n alternatives, most likely first
    top_logprobs: list[float]


@dataclass
class StepResult:
    step_id: int
    # requests that sampled a token this step, in batch order
    request_ids: list[str] = field(default_factory=list)
    # request_ids[i] -> the token it sampled
    sampled_token_ids: list[int] = field(default_factory=list)
    # request_ids[i] -> logprobs, or None where the request did not ask for them
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)


# -- frontend <-> scheduler ---------------------------------------------------------------


@dataclass
class AddRequest:
    """A tokenized, validated request from a frontend; the scheduler re-validates it."""

    request_id: str  # unique per frontend; the scheduler scopes it by frontend identity
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float  # time.time() at the frontend
    priority: int = 0  # lower runs first; ties in arrival order

    def __repr__(self) -> str:
        return f"AddRequest(id={self.request_id!r}, prompt={len(self.prompt_token_ids)} tokens)"


@dataclass
class AbortRequest:
    request_ids: list[str]
    index: int | None = None  # only this sample of each request (a stop string hit it)


@dataclass
class RequestOutput:
    """What one sample of a request gained in one step."""

    request_id: str  # the id the frontend gave
    index: int  # which of the request's n samples
    new_token_ids: list[int]
    # new_token_ids[i] -> logprobs, or None where the request did not ask for them
    new_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort"; None while running
    stop_reason: int | None = None  # the stop token id that ended it, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutputs:
    """One scheduler step's outputs for one frontend."""

    outputs: list[RequestOutput] = field(default_factory=list)


@dataclass
class RequestError:
    """A request rejected or failed; nothing is held for it any more."""

    request_id: str
    code: str  # "invalid_request", "too_long", "duplicate_id", "overloaded", "engine_error"
    message: str


# -- worker -> scheduler handshake ----------------------------------------------------------


@dataclass
class WorkerReady:
    rank: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]


# -- client <-> frontend (the native ZMQ API of pagoda.client) -------------------------------
# A client connects a DEALER to a frontend's ROUTER; request ids are scoped per client
# connection. The frontend tokenizes, applies the chat template and detokenizes.


@dataclass
class ChatMessage:
    role: str
    content: str


@dataclass
class GenerateRequest:
    """Exactly one of prompt, prompt_token_ids, messages is set."""

    request_id: str
    sampling_params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None  # rendered through the model's chat template
    stream: bool = True  # deltas as they come; else one GenerateOutput per sample at the end
    add_generation_prompt: bool = True

    def __repr__(self) -> str:
        return f"GenerateRequest(id={self.request_id!r}, stream={self.stream})"


@dataclass
class GenerateOutput:
    """New text of one sample (streaming), or all of it (not streaming)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: str | None = None  # the stop string, or the stop token id as text
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # of this sample, so far
    num_cached_tokens: int = 0


# -- scheduler <-> frontends: liveness and the authoritative engine figures -------------------


@dataclass
class Heartbeat:
    """Frontend -> scheduler, about once a second; answered with EngineStats."""

    frontend_id: str


@dataclass
class Histogram:
    """Prometheus-style: counts per bucket (upper bounds ascending, then +Inf)."""

    bounds: list[float]
    counts: list[int]  # len(bounds) + 1, not cumulative
    total: float  # sum of the observations
    count: int


@dataclass
class MalformedCount:
    socket: str
    reason: str
    count: int


@dataclass
class EngineStats:
    """Scheduler -> every frontend: the figures only the scheduler knows, so each
    frontend's /metrics shows the same, complete numbers however many there are."""

    running: int
    waiting: int
    kv_usage: float  # fraction of the KV block pool held
    num_kv_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up (counter)
    prefix_cache_hits: int  # of those, found (counter)
    num_preemptions: int  # counter
    prompt_tokens: int  # counter, prompts of finished requests
    generation_tokens: int  # counter
    finished_stop: int  # requests (samples) by finish reason, counters
    finished_length: int
    finished_abort: int
    time_to_first_token: Histogram  # seconds, from the frontend's arrival time
    inter_token_latency: Histogram  # seconds between tokens of one sample
    e2e_latency: Histogram  # seconds, arrival to finish
    queue_time: Histogram  # seconds, arrival to first scheduled
    invariant_failures: int
    malformed_frames: list[MalformedCount] = field(default_factory=list)
