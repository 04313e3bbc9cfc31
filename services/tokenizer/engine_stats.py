"""What a frontend knows about the engine: liveness for /health, figures for /metrics.

The engine client sends the scheduler a ``Heartbeat`` about once a second and hands
every ``EngineStats`` answer to ``EngineStatsView.update``. The scheduler is the
source of truth for every engine figure (so /metrics is the same on every frontend
sharing the HTTP port); this frontend adds only its own dropped-frame counts.

Health is truthful: unhealthy until the first answer, when no answer came for
``stale_after_s`` (the scheduler is gone or wedged; it exits when a worker dies, so
a dead worker shows up here too), after an ``engine_error`` from the scheduler, and
while the instance drains.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shared.codec import MalformedFrameCounter
from shared.protocol import EngineStats, Histogram

PREFIX = "pagoda:"
# a step of a long prefill holds the scheduler's loop for seconds on a CPU
DEFAULT_STALE_AFTER_S = 30.0


class EngineStatsView:
    def __init__(self, frontend_id: str, counter: MalformedFrameCounter,
                 stale_after_s: float = DEFAULT_STALE_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.frontend_id = frontend_id
        self._counter = counter
        self._stale_after = stale_after_s
        self._clock = clock
        self.latest: EngineStats | None = None
        self._received_at: float | None = None
        self._engine_dead: str | None = None
        self._draining = False

    def update(self, stats: EngineStats) -> None:
        self.latest = stats
        self._received_at = self._clock()

    def mark_engine_dead(self, reason: str) -> None:
        self._engine_dead = reason

    def set_draining(self) -> None:
        self._draining = True

    def health(self) -> tuple[bool, str]:
        """(healthy, reason); the reason says what is wrong, or "ok"."""
        if self._draining:
            return False, "draining: the frontend is shutting down"
        if self._engine_dead is not None:
            return False, f"engine dead: {self._engine_dead}"
        if self._received_at is None:
            return False, "no answer from the scheduler yet"
        silent = self._clock() - self._received_at
        if silent > self._stale_after:
            return False, f"the scheduler has not answered for {silent:.0f}s"
        return True, "ok"

    def render_metrics(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self))
        return generate_latest(registry), CONTENT_TYPE_LATEST

    def frontend_malformed(self) -> dict[tuple[str, str], int]:
        return self._counter.snapshot()


class _Collector:
    def __init__(self, view: EngineStatsView) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(PREFIX + "frontend_info", "the frontend process that answered",
                                 labels=["frontend_id"])
        info.add_metric([self.view.frontend_id], 1.0)
        yield info
        healthy, _ = self.view.health()
        up = GaugeMetricFamily(PREFIX + "engine_healthy", "1 when the engine answers and is not draining")
        up.add_metric([], 1.0 if healthy else 0.0)
        yield up
        malformed = CounterMetricFamily(PREFIX + "malformed_frames", "ZMQ frames dropped as malformed",
                                        labels=["process", "socket", "reason"])
        for (sock, reason), n in sorted(self.view.frontend_malformed().items()):
            malformed.add_metric([self.view.frontend_id, sock, reason], n)
        s = self.view.latest
        if s is not None:
            for m in s.malformed_frames:
                malformed.add_metric(["scheduler", m.socket, m.reason], m.count)
        yield malformed
        if s is None:
            return
        yield from _gauges(s)
        yield from _counters(s)
        for name, doc, hist in (
            ("time_to_first_token_seconds", "time to first token", s.time_to_first_token),
            ("inter_token_latency_seconds", "time between tokens of one sample", s.inter_token_latency),
            ("e2e_request_latency_seconds", "arrival to finish", s.e2e_latency),
            ("request_queue_time_seconds", "arrival to first scheduled", s.queue_time),
        ):
            yield _histogram(PREFIX + name, doc, hist)


def _gauges(s: EngineStats) -> Iterator[Metric]:
    for name, doc, value in (
        ("num_requests_running", "sequences running", s.running),
        ("num_requests_waiting", "sequences waiting (preempted ones included)", s.waiting),
        ("kv_cache_usage_perc", "fraction of the KV block pool held (1 = full)", s.kv_usage),
        ("num_kv_blocks", "KV blocks in the pool", s.num_kv_blocks),
    ):
        g = GaugeMetricFamily(PREFIX + name, doc)
        g.add_metric([], float(value))
        yield g


def _counters(s: EngineStats) -> Iterator[Metric]:
    for name, doc, value in (
        ("prompt_tokens", "prompt tokens of finished requests", s.prompt_tokens),
        ("generation_tokens", "generated tokens", s.generation_tokens),
        ("prefix_cache_queries", "prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
        ("prefix_cache_hits", "prompt tokens found in the prefix cache", s.prefix_cache_hits),
        ("num_preemptions", "preemptions", s.num_preemptions),
        ("block_invariant_failures", "block accounting checks that failed", s.invariant_failures),
    ):
        c = CounterMetricFamily(PREFIX + name, doc)
        c.add_metric([], float(value))
        yield c
    done = CounterMetricFamily(PREFIX + "request_success", "finished samples by finish reason",
                               labels=["finished_reason"])
    for reason, value in (("stop", s.finished_stop), ("length", s.finished_length), ("abort", s.finished_abort)):
        done.add_metric([reason], float(value))
    yield done


def _histogram(name: str, doc: str, h: Histogram) -> Metric:
    buckets, cumulative = [], 0
    for bound, count in zip([*map(str, h.bounds), "+Inf"], h.counts):
        cumulative += count
        buckets.append((bound, float(cumulative)))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=h.total)
