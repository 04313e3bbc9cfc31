"""The scheduler's request-level figures: latency histograms and token/request counters.

The scheduler process feeds it every step (which sequences were first scheduled,
which outputs came back) and every abort; ``snapshot`` turns it, together with the
scheduler core's own statistics, into the ``EngineStats`` message every frontend
receives. Keeping these figures here, not in the frontends, makes every frontend's
/metrics complete however many frontends share the HTTP port.

Times are wall-clock seconds (``time.time()``), because a request's arrival time is
stamped by its frontend, possibly in another process.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from services.scheduler.request import request_id_of, seq_id_of
from services.scheduler.scheduler import SchedulerStats
from shared.codec import MalformedFrameCounter
from shared.protocol import EngineStats, Histogram, MalformedCount, RequestOutput, StepBatch

# vLLM's bucket choices (seconds), so dashboards built for it read ours the same way
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


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


@dataclass
class _Timing:
    arrival: float
    num_prompt_tokens: int
    last_token: dict[int, float] = field(default_factory=dict)  # sample index -> time
    num_open_samples: int = 1


class EngineMetrics:
    def __init__(self) -> None:
        self.ttft = HistogramAccumulator(TTFT_BUCKETS)
        self.itl = HistogramAccumulator(ITL_BUCKETS)
        self.e2e = HistogramAccumulator(REQUEST_BUCKETS)
        self.queue = HistogramAccumulator(REQUEST_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = {"stop": 0, "length": 0, "abort": 0}
        self._timings: dict[str, _Timing] = {}  # scheduler request id -> timing
        self._queued: set[str] = set()  # seq ids not yet scheduled once

    def on_add(self, request_id: str, seq_ids: list[str], arrival: float, num_prompt_tokens: int) -> None:
        self._timings[request_id] = _Timing(arrival, num_prompt_tokens, num_open_samples=len(seq_ids))
        self._queued.update(seq_ids)

    def on_step(self, batch: StepBatch, now: float) -> None:
        for new in batch.new_requests:
            if new.request_id in self._queued:
                self._queued.discard(new.request_id)
                timing = self._timings.get(request_id_of(new.request_id))
                if timing is not None:
                    self.queue.observe(now - timing.arrival)

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """Outputs as the scheduler core returned them (scheduler request ids)."""
        for out in outputs:
            timing = self._timings.get(out.request_id)
            if timing is None:
                continue
            if out.new_token_ids:
                last = timing.last_token.get(out.index)
                if last is None:
                    self.ttft.observe(now - timing.arrival)
                else:
                    self.itl.observe(now - last)
                timing.last_token[out.index] = now
                self.generation_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                self.finished[out.finish_reason] = self.finished.get(out.finish_reason, 0) + 1
                self.e2e.observe(now - timing.arrival)
                timing.num_open_samples -= 1
                if out.new_token_ids == [] and out.index not in timing.last_token:
                    self._queued.discard(seq_id_of(out.request_id, out.index))  # never ran
                if timing.num_open_samples <= 0:
                    self.prompt_tokens += timing.num_prompt_tokens
                    del self._timings[out.request_id]

    def snapshot(self, stats: SchedulerStats, num_kv_blocks: int, counter: MalformedFrameCounter) -> EngineStats:
        return EngineStats(
            running=stats.running, waiting=stats.waiting, kv_usage=stats.kv_usage,
            num_kv_blocks=num_kv_blocks, prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits, num_preemptions=stats.num_preemptions,
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            finished_stop=self.finished["stop"], finished_length=self.finished["length"],
            finished_abort=self.finished["abort"],
            time_to_first_token=self.ttft.message(), inter_token_latency=self.itl.message(),
            e2e_latency=self.e2e.message(), queue_time=self.queue.message(),
            invariant_failures=stats.invariant_failures,
            malformed_frames=[MalformedCount(s, r, n) for (s, r), n in sorted(counter.snapshot().items())],
        )
