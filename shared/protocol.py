"""Every message that crosses a process boundary, declared once, with its wire schema.

Links (who sends what to whom), each with one decoder below (``Link``):
- frontend -> scheduler: ``AddRequest``, ``AbortRequest``, ``Heartbeat``;
- scheduler -> frontend: ``EngineOutputs`` (one batch per step per frontend),
  ``RequestError`` (a typed rejection of one request), ``EngineStats``;
- scheduler -> workers: ``StepBatch``;
- workers -> scheduler: ``WorkerReady`` (the KV capacity handshake), ``StepResult``
  (rank 0, one per step);
- client -> frontend (pagoda.client): ``GenerateRequest``, ``AbortRequest``;
- frontend -> client: ``GenerateOutput``, ``RequestError``.

The worker link, one step of the continuous batch:

``StepBatch`` is a delta, as in vLLM v1: a request's tokens, sampling params and
block table travel once, when it is first scheduled or resumed after preemption
(``new_requests``); later steps carry only its newly appended blocks
(``running_requests``). ``finished_request_ids`` tells workers to drop the state of
requests that finished, were aborted or were preempted (a preempted request comes
back later as a new request with all its tokens).

Requests are named on this link by ``SeqId``, a compact int the scheduler mints per
sequence (a sample of a request), never by the frontends' string request ids.
The order of ``scheduled_request_ids`` is the order of the flattened token batch;
``StepResult`` lists, in that order, the requests that sampled a token this step
(a request in the middle of a chunked prefill samples nothing).

Messages are ``msgspec.Struct``s: ``array_like`` (a message is a msgpack array of its
fields in declaration order), tagged with a fixed int per top-level kind (the first
array item; never reuse a number), ``forbid_unknown_fields`` (a longer array than the
decoder knows is rejected). The annotations are the schema: a typed decode checks
types and ``Meta`` ranges in C; ``__post_init__`` checks what Meta cannot express
(finite floats, parallel list lengths) and runs on decode and on construction.
Append new fields last, with defaults, so older peers' frames still decode.
The frame envelope and ``safe_decode`` live in ``shared/codec.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal, cast, get_args

import msgspec

from shared.sampling_params import SamplingParams

# Bump only for a change older peers cannot read (a removed or retyped field).
WIRE_VERSION = 1

MAX_STR_LEN = 1 << 20  # one string (request id, prompt, error message), in characters

# Ints on the wire: counts and ids are non-negative int64; token and block ids fit int32
# (the worker's tensors); AddRequest.priority is signed.
Count = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]  # token ids and KV block ids
SeqId = Count  # the worker link's request id: one sequence, minted by the scheduler
Text = Annotated[str, msgspec.Meta(max_length=MAX_STR_LEN)]


class _Wire(
    msgspec.Struct, array_like=True, omit_defaults=True, gc=False, forbid_unknown_fields=True
):
    """Base of every wire struct (the options are inherited). ``omit_defaults`` does not
    shorten ``array_like`` structs in msgspec 0.22; it is set for when it does."""


def _finite(where: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{where}: must be finite, got {value}")


def _finite_list(where: str, values: Sequence[float], allow_neg_inf: bool = False) -> None:
    if not values or math.isfinite(sum(values)):  # the common case, in C
        return
    for v in values:
        if math.isnan(v) or v == math.inf or (v == -math.inf and not allow_neg_inf):
            raise ValueError(f"{where}: must be finite, got {v}")


def _same_length(where: str, a: Sequence[Any], b: Sequence[Any], names: str) -> None:
    if len(a) != len(b):
        raise ValueError(f"{where}: {names} have {len(a)} and {len(b)} items")


# -- scheduler <-> workers -------------------------------------------------------------------


class NewRequest(_Wire):
    """A request the workers have no state for: sent in full, once."""

    request_id: SeqId
    # prompt tokens followed by any output tokens generated before a preemption
    token_ids: list[TokenId]
    # token_ids[:num_prompt_tokens] is the prompt (penalties tell prompt from output)
    num_prompt_tokens: Count
    sampling_params: SamplingParams
    # physical KV block ids, in logical order; covers at least the tokens of this step
    block_ids: list[TokenId]
    # tokens whose K/V are already in the cache (prefix-cache hit); computing starts here
    num_computed_tokens: Count

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if self.num_prompt_tokens > n or self.num_computed_tokens > n:
            raise ValueError(f"NewRequest: counts exceed its {n} tokens")

    def __repr__(self) -> str:  # token ids are long and may be private
        return (
            f"NewRequest(id={self.request_id!r}, tokens={len(self.token_ids)}, "
            f"prompt={self.num_prompt_tokens}, blocks={len(self.block_ids)}, "
            f"computed={self.num_computed_tokens})"
        )


class RunningRequest(_Wire):
    """A request the workers already hold: only what changed since last step."""

    request_id: SeqId
    # blocks appended to the end of its block table since its last step
    new_block_ids: list[TokenId] = []


class StepBatch(_Wire, tag=5):
    step_id: Count
    new_requests: list[NewRequest] = []
    running_requests: list[RunningRequest] = []
    # request_id of every request computed this step, in batch order
    scheduled_request_ids: list[SeqId] = []
    # scheduled_request_ids[i] -> number of tokens it computes this step (>= 1)
    num_scheduled_tokens: list[Count] = []
    # requests whose worker state is dropped before this step runs
    finished_request_ids: list[SeqId] = []
    # structured output (appended for issue 16): the sequences that sample this step under a
    # grammar whose mask excludes some token, in batch order, and their masks: one row each
    # of ceil(vocab_size / 32) little-endian int32 words; bit j of word w allows token
    # 32 * w + j (xgrammar's bitmask layout). Empty when no sequence of the step has one.
    grammar_seq_ids: list[SeqId] = []
    grammar_bitmasks: bytes = b""

    def __post_init__(self) -> None:
        _same_length("StepBatch", self.scheduled_request_ids, self.num_scheduled_tokens,
                     "scheduled_request_ids and num_scheduled_tokens")
        rows = len(self.grammar_seq_ids)
        size = len(self.grammar_bitmasks)
        if (size == 0) != (rows == 0) or (rows and size % (4 * rows)):
            raise ValueError(f"StepBatch: {size} bitmask bytes for {rows} grammar rows")

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def __repr__(self) -> str:
        return (
            f"StepBatch(step={self.step_id}, new={len(self.new_requests)}, "
            f"running={len(self.running_requests)}, tokens={self.total_num_scheduled_tokens}, "
            f"finished={len(self.finished_request_ids)}, grammars={len(self.grammar_seq_ids)})"
        )


class TokenLogprobs(_Wire):
    """Logprobs of one sampled token, from the raw model distribution (-inf allowed)."""

    logprob: float  # of the sampled token
    rank: Count  # 1 = the most likely token
    top_token_ids: list[TokenId]  # the top-n alternatives, most likely first
    top_logprobs: list[float]

    def __post_init__(self) -> None:
        _finite_list("TokenLogprobs.logprob", (self.logprob,), allow_neg_inf=True)
        _finite_list("TokenLogprobs.top_logprobs", self.top_logprobs, allow_neg_inf=True)
        _same_length("TokenLogprobs", self.top_token_ids, self.top_logprobs,
                     "top_token_ids and top_logprobs")


class PromptLogprobs(_Wire):
    """The prompt logprobs one chunk of a sequence's prefill computed: ``logprobs[i]`` is
    prompt token ``start + i`` under the model's distribution after tokens ``[0, start + i)``."""

    request_id: SeqId
    start: Count  # >= 1: the first prompt token has no logprob
    logprobs: list[TokenLogprobs]  # logprob and rank of the prompt token itself; top-k


class StepResult(_Wire, tag=6):
    step_id: Count
    # requests that sampled a token this step, in batch order
    request_ids: list[SeqId] = []
    # request_ids[i] -> the token it sampled
    sampled_token_ids: list[TokenId] = []
    # request_ids[i] -> logprobs, or None where the request did not ask for them;
    # empty when no request of the step asked
    logprobs: list[TokenLogprobs | None] = []
    # one entry per sequence asking prompt_logprobs whose prompt this step computed part
    # of; empty when none did (appended for issue 16)
    prompt_logprobs: list[PromptLogprobs] = []

    def __post_init__(self) -> None:
        _same_length("StepResult", self.request_ids, self.sampled_token_ids,
                     "request_ids and sampled_token_ids")
        if self.logprobs:
            _same_length("StepResult", self.request_ids, self.logprobs,
                         "request_ids and logprobs")


class WorkerReady(_Wire, tag=7):
    """Worker -> scheduler at start-up: the KV capacity handshake."""

    rank: Count
    num_kv_blocks: Count
    block_size: Count
    max_model_len: Count
    vocab_size: Count
    eos_token_ids: list[TokenId]


# -- frontend <-> scheduler ---------------------------------------------------------------


class AddRequest(_Wire, tag=1):
    """A tokenized, validated request from a frontend; the scheduler re-validates it."""

    request_id: Text  # unique per frontend; the scheduler scopes it by frontend identity
    prompt_token_ids: list[TokenId]
    sampling_params: SamplingParams
    arrival_time: float  # time.time() at the frontend
    priority: Int64 = 0  # lower runs first; ties in arrival order

    def __post_init__(self) -> None:
        _finite("AddRequest.arrival_time", self.arrival_time)

    def __repr__(self) -> str:
        return f"AddRequest(id={self.request_id!r}, prompt={len(self.prompt_token_ids)} tokens)"


class AbortRequest(_Wire, tag=2):
    request_ids: list[Text]
    index: Count | None = None  # only this sample of each request (a stop string hit it)


class EngineOutput(_Wire):
    """What one sample of a request gained in one step."""

    request_id: Text  # the id the frontend gave
    index: Count  # which of the request's n samples
    new_token_ids: list[TokenId]
    # new_token_ids[i] -> logprobs, or None where the request did not ask for them
    new_logprobs: list[TokenLogprobs | None] = []
    finish_reason: Text | None = None  # "stop", "length", "abort"; None while running
    stop_reason: TokenId | None = None  # the stop token id that ended it, if any
    num_prompt_tokens: Count = 0
    num_cached_tokens: Count = 0  # prompt tokens served from the prefix cache
    # every prompt token's logprobs (the first None), once, with sample 0's first token,
    # when the request asked prompt_logprobs (appended for issue 16)
    prompt_logprobs: list[TokenLogprobs | None] = []

    def __post_init__(self) -> None:
        if self.new_logprobs:
            _same_length("EngineOutput", self.new_token_ids, self.new_logprobs,
                         "new_token_ids and new_logprobs")

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class EngineOutputs(_Wire, tag=3):
    """One scheduler step's outputs for one frontend."""

    outputs: list[EngineOutput] = []


class RequestError(_Wire, tag=4):
    """A request rejected or failed; nothing is held for it any more."""

    request_id: Text
    code: Text  # "invalid_request", "too_long", "duplicate_id", "overloaded", "engine_error"
    message: Text


# -- client <-> frontend (the native ZMQ API of pagoda.client) -------------------------------
# A client connects a DEALER to a frontend's ROUTER; request ids are scoped per client
# connection. The frontend tokenizes, applies the chat template and detokenizes.


class ToolCall(_Wire):
    """A call the model made: whole, or streamed as pieces (the first piece of a call has
    its id and name, the rest add to its ``arguments``); ``index`` is the call's place
    among the sample's calls. In a ``ChatMessage``, a call an assistant made earlier."""

    index: Count
    id: Text | None = None
    name: Text | None = None
    arguments: Text = ""  # JSON text of the call's arguments (whole or a piece)


class ToolFunction(_Wire):
    """A function tool the model may call (OpenAI's ``tools[].function``)."""

    name: Text
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema


class ChatMessage(_Wire):
    role: Text
    content: Text | None  # None: an assistant turn that only called tools
    tool_calls: list[ToolCall] = []  # role "assistant"
    tool_call_id: Text | None = None  # role "tool": the call it answers
    name: Text | None = None


class GenerateRequest(_Wire, tag=8):
    """Exactly one of prompt, prompt_token_ids, messages is set."""

    request_id: Text
    sampling_params: SamplingParams
    prompt: Text | None = None
    prompt_token_ids: list[TokenId] | None = None
    messages: list[ChatMessage] | None = None  # rendered through the model's chat template
    stream: bool = True  # deltas as they come; else one GenerateOutput per sample at the end
    add_generation_prompt: bool = True
    # tool calling (with messages): the tools the chat template renders; tool_choice
    # "none", "auto" (the default with tools), "required", or "function" (tool_function
    # names it); the frontend parses calls into GenerateOutput.tool_calls
    tools: list[ToolFunction] = []
    tool_choice: Literal["none", "auto", "required", "function"] | None = None
    tool_function: Text | None = None
    parallel_tool_calls: bool = True
    # vLLM's prompt options (issue 24): special tokens added when tokenizing (None: yes
    # for a prompt, no for messages), the last assistant message continued, template vars
    add_special_tokens: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if (self.tool_choice == "function") != (self.tool_function is not None):
            raise ValueError('GenerateRequest: tool_function is set exactly when tool_choice '
                             'is "function"')

    def __repr__(self) -> str:
        return f"GenerateRequest(id={self.request_id!r}, stream={self.stream})"


class GenerateOutput(_Wire, tag=9):
    """New text of one sample (streaming), or all of it (not streaming)."""

    request_id: Text
    index: Count
    text: Text
    token_ids: list[TokenId]
    logprobs: list[TokenLogprobs | None] = []
    finish_reason: Text | None = None  # "stop", "length", "abort"
    stop_reason: Text | None = None  # the stop string, or the stop token id as text
    num_prompt_tokens: Count = 0
    num_output_tokens: Count = 0  # of this sample, so far
    num_cached_tokens: Count = 0
    # with prompt_logprobs, in each sample's first output: the prompt's token ids and
    # their logprobs (the first None) (appended for issue 16)
    prompt_token_ids: list[TokenId] = []
    prompt_logprobs: list[TokenLogprobs | None] = []
    # with tools: the calls parsed from the sample's text (``text`` is then the rest);
    # streamed as pieces, see ToolCall
    tool_calls: list[ToolCall] = []

    def __post_init__(self) -> None:
        if self.prompt_logprobs:
            _same_length("GenerateOutput", self.prompt_token_ids, self.prompt_logprobs,
                         "prompt_token_ids and prompt_logprobs")


# -- scheduler <-> frontends: liveness and the authoritative engine figures -------------------


class Heartbeat(_Wire, tag=10):
    """Frontend -> scheduler, about once a second; answered with EngineStats."""

    frontend_id: Text


class Histogram(_Wire):
    """Prometheus-style: counts per bucket (upper bounds ascending, then +Inf)."""

    bounds: list[float]
    counts: list[Count]  # len(bounds) + 1, not cumulative
    total: float  # sum of the observations
    count: Count

    def __post_init__(self) -> None:
        _finite_list("Histogram.bounds", self.bounds)
        _finite("Histogram.total", self.total)


class MalformedCount(_Wire):
    socket: Text
    reason: Text
    count: Count


def _no_observations() -> Histogram:
    return Histogram([], [0], 0.0, 0)


class EngineStats(_Wire, tag=11):
    """Scheduler -> every frontend: the figures only the scheduler knows, so each
    frontend's /metrics shows the same, complete numbers however many there are."""

    running: Count
    waiting: Count
    kv_usage: float  # fraction of the KV block pool held
    num_kv_blocks: Count
    prefix_cache_queries: Count  # prompt tokens looked up (counter)
    prefix_cache_hits: Count  # of those, found (counter)
    num_preemptions: Count  # counter
    prompt_tokens: Count  # counter, prompts of finished requests
    generation_tokens: Count  # counter
    finished_stop: Count  # requests (samples) by finish reason, counters
    finished_length: Count
    finished_abort: Count
    time_to_first_token: Histogram  # seconds, from the frontend's arrival time
    inter_token_latency: Histogram  # seconds between tokens of one sample
    e2e_latency: Histogram  # seconds, arrival to finish
    queue_time: Histogram  # seconds, arrival to first scheduled
    invariant_failures: Count
    malformed_frames: list[MalformedCount] = []
    # appended for vLLM's metric names (services/tokenizer/engine_stats.py renders them):
    # labels, then figures with vLLM's definitions (services/scheduler/metrics.py)
    model_name: Text = ""  # the served model name, the first of --served-model-name
    cache_dtype: Text = ""
    block_size: Count = 0
    enable_prefix_caching: bool = False
    waiting_deferred: Count = 0  # of waiting: held back by a grammar still compiling
    prompt_tokens_computed: Count = 0  # counter, per sequence at its first token
    prompt_tokens_cached: Count = 0  # counter, of those prompts: prefix-cache hits
    # seconds, of finished sequences: first scheduled -> first token -> last token
    prefill_time: Histogram = msgspec.field(default_factory=_no_observations)
    decode_time: Histogram = msgspec.field(default_factory=_no_observations)
    inference_time: Histogram = msgspec.field(default_factory=_no_observations)
    request_time_per_output_token: Histogram = msgspec.field(default_factory=_no_observations)
    request_prompt_tokens: Histogram = msgspec.field(default_factory=_no_observations)
    request_generation_tokens: Histogram = msgspec.field(default_factory=_no_observations)
    request_max_num_generation_tokens: Histogram = msgspec.field(default_factory=_no_observations)
    request_params_n: Histogram = msgspec.field(default_factory=_no_observations)
    request_params_max_tokens: Histogram = msgspec.field(default_factory=_no_observations)
    request_prefill_kv_computed_tokens: Histogram = msgspec.field(default_factory=_no_observations)
    iteration_tokens: Histogram = msgspec.field(default_factory=_no_observations)  # per step
    kv_events_published: Count = 0  # KV event batches sent (counter)
    kv_events_dropped: Count = 0  # KV event batches a slow subscriber kept from going out

    def __post_init__(self) -> None:
        _finite("EngineStats.kv_usage", self.kv_usage)
        for h in (self.time_to_first_token, self.inter_token_latency, self.e2e_latency,
                  self.queue_time, self.prefill_time, self.decode_time, self.inference_time,
                  self.request_time_per_output_token, self.request_prompt_tokens,
                  self.request_generation_tokens, self.request_max_num_generation_tokens,
                  self.request_params_n, self.request_params_max_tokens,
                  self.request_prefill_kv_computed_tokens, self.iteration_tokens):
            if len(h.counts) != len(h.bounds) + 1:  # the renderer zips them
                raise ValueError("EngineStats: a histogram needs len(bounds) + 1 counts")


class WorkerHeartbeat(_Wire, tag=12):
    """A worker rank is alive and connected (every ``WORKER_HEARTBEAT_S``, on the result
    link, from its own thread, whatever its step is doing). The scheduler knows a worker
    by these, not by counting step subscriptions, which any peer can make."""

    rank: Count


# -- links: one tagged union and one decoder per socket direction ----------------------------

FrontendToScheduler = AddRequest | AbortRequest | Heartbeat
SchedulerToFrontend = EngineOutputs | RequestError | EngineStats
SchedulerToWorker = StepBatch
WorkerToScheduler = WorkerReady | StepResult | WorkerHeartbeat
ClientToFrontend = GenerateRequest | AbortRequest
FrontendToClient = GenerateOutput | RequestError
AnyMessage = (
    AddRequest | AbortRequest | EngineOutputs | RequestError | StepBatch | StepResult
    | WorkerReady | GenerateRequest | GenerateOutput | Heartbeat | EngineStats | WorkerHeartbeat
)
# every top-level message type, in tag order
MESSAGE_TYPES: tuple[type[_Wire], ...] = tuple(
    sorted(get_args(AnyMessage), key=lambda cls: cast(int, cls.__struct_config__.tag))
)


class Link:
    """The messages one socket direction accepts, and the decoder that checks them.

    The decoder reads the whole frame envelope, ``[WIRE_VERSION, [tag, *fields]]``, in
    one typed pass: a version other than ours, a tag outside this union or a field of
    the wrong type or range is a ``msgspec.ValidationError``. ``name`` is the socket
    name its dropped frames are counted under (the endpoint, or the client).
    """

    __slots__ = ("decoder", "name", "types")

    def __init__(self, name: str, union: Any) -> None:
        self.name = name
        self.types: tuple[type[_Wire], ...] = get_args(union) or (union,)
        envelope = tuple[Literal[WIRE_VERSION], union]  # type: ignore[valid-type]
        self.decoder = msgspec.msgpack.Decoder(envelope)

    def __repr__(self) -> str:
        return f"Link({self.name}: {' | '.join(t.__name__ for t in self.types)})"


FRONTEND_TO_SCHEDULER = Link("scheduler_frontend", FrontendToScheduler)
SCHEDULER_TO_FRONTEND = Link("scheduler_frontend", SchedulerToFrontend)
SCHEDULER_TO_WORKER = Link("worker_step", SchedulerToWorker)
WORKER_TO_SCHEDULER = Link("scheduler_result", WorkerToScheduler)
CLIENT_TO_FRONTEND = Link("frontend_native", ClientToFrontend)
FRONTEND_TO_CLIENT = Link("client", FrontendToClient)
ANY_MESSAGE = Link("any", AnyMessage)  # tests and tools; a socket decodes with its own link
LINKS: tuple[Link, ...] = (
    FRONTEND_TO_SCHEDULER, SCHEDULER_TO_FRONTEND, SCHEDULER_TO_WORKER, WORKER_TO_SCHEDULER,
    CLIENT_TO_FRONTEND, FRONTEND_TO_CLIENT,
)
