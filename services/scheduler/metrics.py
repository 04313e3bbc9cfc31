"""The scheduler's request-level figures: latency histograms and token/request counters.

The scheduler core owns one ``EngineMetrics`` and feeds it at the moments that define
each figure (a sequence first scheduled, a token appended, a sequence finished); the
timestamps themselves live on the ``Request``. ``snapshot`` turns the figures, with the
core's own statistics, into the ``EngineStats`` message every frontend receives, so
every frontend's /metrics is complete however many frontends share the HTTP port.

Times are wall-clock seconds (``time.time()``), because a request's arrival time is
stamped by its frontend, possibly in another process.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from services.scheduler.request import FINISH_REASONS, Request, RequestStatus
from shared.codec import MalformedFrameCounter
from shared.protocol import EngineStats, Histogram, MalformedCount

# vLLM's bucket choices (seconds), so dashboards built for it read ours the same way
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


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


@dataclass
class HistogramAccumulator:
    bounds: list[float]
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
        return Histogram(list(self.bounds), list(self.counts), self.total, self.count)


class EngineMetrics:
    """Histograms and counters only; the scheduler core calls the ``on_*`` hooks."""

    def __init__(self) -> None:
        self.ttft = HistogramAccumulator(TTFT_BUCKETS)
        self.itl = HistogramAccumulator(ITL_BUCKETS)
        self.e2e = HistogramAccumulator(REQUEST_BUCKETS)
        self.queue = HistogramAccumulator(REQUEST_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = {reason: 0 for reason in FINISH_REASONS.values()}

    def on_first_scheduled(self, req: Request, now: float) -> None:
        self.queue.observe(now - req.arrival_time)

    def on_token(self, req: Request, now: float) -> None:
        """Before ``req``'s token timestamps are moved to ``now``."""
        if req.last_token_time is None:
            self.ttft.observe(now - req.arrival_time)
        else:
            self.itl.observe(now - req.last_token_time)
        self.generation_tokens += 1

    def on_finished(self, req: Request, now: float, last_of_request: bool) -> None:
        reason = FINISH_REASONS[RequestStatus(req.status)]
        self.finished[reason] += 1
        self.e2e.observe(now - req.arrival_time)
        if last_of_request:  # a prompt counts once, however many samples share it
            self.prompt_tokens += req.num_prompt_tokens

    def snapshot(self, stats: SchedulerStats, counter: MalformedFrameCounter) -> EngineStats:
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
            malformed_frames=[MalformedCount(s, r, n) for (s, r), n in sorted(counter.snapshot().items())],
        )
