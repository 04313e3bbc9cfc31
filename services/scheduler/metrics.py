"""The scheduler's request-level figures: latency histograms and token/request counters.

The scheduler core owns one ``EngineMetrics`` and feeds it at the moments that define
each figure (a sequence first scheduled, a token appended, a step's tokens all in, a
sequence finished); the timestamps themselves live on the ``Request``. ``snapshot``
turns the figures, with the core's own statistics, into the ``EngineStats`` message
every frontend receives, so every frontend's /metrics is complete however many
frontends share the HTTP port. The frontends render them under vLLM's names
(``services/tokenizer/engine_stats.py``); the figures follow vLLM's definitions
(``vllm/v1/metrics/stats.py``, ``loggers.py``), per sequence (a sample of ``n``) where
vLLM counts per request, since vLLM runs each of ``n`` samples as a request.

Times are wall-clock seconds (``time.time()``), because a request's arrival time is
stamped by its frontend, possibly in another process.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from services.scheduler.request import FINISH_REASONS, Request, RequestStatus
from shared.codec import MalformedFrameCounter
from shared.protocol import EngineStats, Histogram, MalformedCount

# vLLM's bucket choices, so dashboards built for it read ours the same way: seconds ...
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
# ... and counts
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_BUCKETS = [1, 2, 5, 10, 20]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


@dataclass
class SchedulerStats:
    running: int  # sequences
    waiting: int  # sequences, preempted ones included
    kv_usage: float  # fraction of the block pool held
    num_kv_blocks: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    invariant_failures: int
    block_size: int = 0
    enable_prefix_caching: bool = False
    waiting_deferred: int = 0  # of waiting: held back by a grammar still compiling


@dataclass(frozen=True)
class EngineInfo:
    """What /metrics labels with: the process's configuration, not the core's."""

    model_name: str = ""  # the served model name (the first of --served-model-name)
    cache_dtype: str = "auto"


class KVEventCounts(Protocol):
    published: int
    dropped: int


@dataclass
class HistogramAccumulator:
    bounds: Sequence[float]  # upper bounds, ascending
    counts: list[int] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        value = max(0.0, value)  # clocks of two processes may disagree slightly
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def message(self) -> Histogram:
        return Histogram([float(b) for b in self.bounds], list(self.counts), self.total, self.count)


class EngineMetrics:
    """Histograms and counters only; the scheduler core calls the ``on_*`` hooks."""

    def __init__(self, max_model_len: int = 2048) -> None:
        tokens = build_1_2_5_buckets(max_model_len)
        self.ttft = HistogramAccumulator(TTFT_BUCKETS)
        self.itl = HistogramAccumulator(ITL_BUCKETS)
        self.e2e = HistogramAccumulator(REQUEST_BUCKETS)
        self.queue = HistogramAccumulator(REQUEST_BUCKETS)
        # of finished sequences that sampled a token: first scheduled -> first token ->
        # last token, and decode time per output token after the first
        self.prefill = HistogramAccumulator(REQUEST_BUCKETS)
        self.decode = HistogramAccumulator(REQUEST_BUCKETS)
        self.inference = HistogramAccumulator(REQUEST_BUCKETS)
        self.time_per_output_token = HistogramAccumulator(ITL_BUCKETS)
        # token counts of finished sequences, and of requests (n, the longest sample)
        self.request_prompt_tokens = HistogramAccumulator(tokens)
        self.request_generation_tokens = HistogramAccumulator(tokens)
        self.request_max_tokens = HistogramAccumulator(tokens)
        self.request_prefill_kv_computed = HistogramAccumulator(tokens)
        self.request_max_generation_tokens = HistogramAccumulator(tokens)
        self.request_n = HistogramAccumulator(N_BUCKETS)
        # per step that sampled: prompts that got their first token + tokens sampled
        self.iteration_tokens = HistogramAccumulator(ITERATION_TOKEN_BUCKETS)
        self._step_tokens = 0
        self.prompt_tokens = 0  # once per request, when its last sample finishes
        # per sequence at its first token: prompt tokens computed / taken from the cache
        self.prompt_tokens_computed = 0
        self.prompt_tokens_cached = 0
        self.generation_tokens = 0
        self.finished = {reason: 0 for reason in FINISH_REASONS.values()}

    def on_first_scheduled(self, req: Request, now: float) -> None:
        self.queue.observe(now - req.arrival_time)

    def on_token(self, req: Request, now: float) -> None:
        """Before ``req``'s token timestamps are moved to ``now``."""
        if req.last_token_time is None:
            self.ttft.observe(now - req.arrival_time)
            self.prompt_tokens_computed += req.num_prompt_tokens - req.num_cached_tokens
            self.prompt_tokens_cached += req.num_cached_tokens
            self._step_tokens += req.num_prompt_tokens
        else:
            self.itl.observe(now - req.last_token_time)
        self.generation_tokens += 1
        self._step_tokens += 1

    def on_step_done(self) -> None:
        """After a step's tokens were all appended."""
        if self._step_tokens:
            self.iteration_tokens.observe(self._step_tokens)
            self._step_tokens = 0

    def on_finished(self, req: Request, now: float, siblings: list[Request] | None) -> None:
        """``siblings``: every sample of the request when ``req`` is its last to finish."""
        reason = FINISH_REASONS[RequestStatus(req.status)]
        self.finished[reason] += 1
        self.e2e.observe(now - req.arrival_time)
        num_out = req.num_output_tokens
        self.request_prompt_tokens.observe(req.num_prompt_tokens)
        self.request_generation_tokens.observe(num_out)
        self.request_prefill_kv_computed.observe(req.num_prompt_tokens - req.num_cached_tokens)
        if req.sampling_params.max_tokens:
            self.request_max_tokens.observe(req.sampling_params.max_tokens)
        first, last = req.first_token_time, req.last_token_time
        if first is not None and last is not None and req.first_scheduled_time is not None:
            self.prefill.observe(first - req.first_scheduled_time)
            self.decode.observe(last - first)
            self.inference.observe(last - req.first_scheduled_time)
            if num_out > 1:
                self.time_per_output_token.observe((last - first) / (num_out - 1))
        if siblings is not None:  # a prompt counts once, however many samples share it
            self.prompt_tokens += req.num_prompt_tokens
            self.request_n.observe(len(siblings))
            self.request_max_generation_tokens.observe(max(s.num_output_tokens for s in siblings))

    def snapshot(self, stats: SchedulerStats, counter: MalformedFrameCounter,
                 info: EngineInfo | None = None,
                 kv_events: KVEventCounts | None = None) -> EngineStats:
        info = info or EngineInfo()
        return EngineStats(
            running=stats.running, waiting=stats.waiting, kv_usage=stats.kv_usage,
            num_kv_blocks=stats.num_kv_blocks, prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits, num_preemptions=stats.num_preemptions,
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            finished_stop=self.finished["stop"], finished_length=self.finished["length"],
            finished_abort=self.finished["abort"],
            time_to_first_token=self.ttft.message(), inter_token_latency=self.itl.message(),
            e2e_latency=self.e2e.message(), queue_time=self.queue.message(),
            invariant_failures=stats.invariant_failures,
            malformed_frames=[MalformedCount(s, r, n)
                              for (s, r), n in sorted(counter.snapshot().items())],
            model_name=info.model_name, cache_dtype=info.cache_dtype,
            block_size=stats.block_size, enable_prefix_caching=stats.enable_prefix_caching,
            waiting_deferred=stats.waiting_deferred,
            prompt_tokens_computed=self.prompt_tokens_computed,
            prompt_tokens_cached=self.prompt_tokens_cached,
            prefill_time=self.prefill.message(), decode_time=self.decode.message(),
            inference_time=self.inference.message(),
            request_time_per_output_token=self.time_per_output_token.message(),
            request_prompt_tokens=self.request_prompt_tokens.message(),
            request_generation_tokens=self.request_generation_tokens.message(),
            request_max_num_generation_tokens=self.request_max_generation_tokens.message(),
            request_params_n=self.request_n.message(),
            request_params_max_tokens=self.request_max_tokens.message(),
            request_prefill_kv_computed_tokens=self.request_prefill_kv_computed.message(),
            iteration_tokens=self.iteration_tokens.message(),
            kv_events_published=kv_events.published if kv_events else 0,
            kv_events_dropped=kv_events.dropped if kv_events else 0,
        )
