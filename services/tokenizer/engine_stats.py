"""What a frontend knows about the engine: liveness for /health, figures for /metrics.

The engine client sends the scheduler a ``Heartbeat`` about once a second and hands
every ``EngineStats`` answer to ``EngineStatsView.update``. The scheduler is the
source of truth for every engine figure (so /metrics is the same on every frontend
sharing the HTTP port); this frontend adds only its own dropped-frame counts.

Two sets of names. ``vllm:*`` is the scale-out contract: every series of vLLM's
``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``) that has a meaning here, with
vLLM's names, types, buckets and label sets (``model_name``, ``engine="0"``), so gateways
that pick endpoints by vLLM's metrics (the Gateway API Inference Extension reads
``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``
and ``vllm:cache_config_info``; llm-d, Dynamo, vLLM's production-stack router) need no
configuration; series vLLM has since retired but gateways still default to
(``vllm:gpu_cache_usage_perc``, ``vllm:gpu_prefix_cache_*``,
``vllm:time_per_output_token_seconds``) are kept as aliases. ``pagoda:*`` is the
original set, unchanged (the benchmarks and dashboards read it), plus what vLLM has no
name for (dropped frames, health, block-accounting failures, KV event batches).

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
from prometheus_client.utils import floatToGoString

from shared.codec import MalformedFrameCounter
from shared.protocol import EngineStats, Histogram

PREFIX = "pagoda:"
VLLM = "vllm:"
ENGINE = "0"  # vLLM's `engine` label: the data-parallel rank; one engine here
# vLLM's finish reasons (vllm/v1/engine FinishReason); error and repetition never happen here
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
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
        # a scheduler whose engine died says so last and exits: figures after that come
        # from a scheduler started since (compose's restart), which this frontend serves
        self._engine_dead = None

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
        yield from _vllm_metrics(s)


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
        ("kv_events_published", "KV event batches sent (--kv-events-endpoint)",
         s.kv_events_published),
        ("kv_events_dropped", "KV event batches dropped: a subscriber was not reading",
         s.kv_events_dropped),
    ):
        c = CounterMetricFamily(PREFIX + name, doc)
        c.add_metric([], float(value))
        yield c
    done = CounterMetricFamily(PREFIX + "request_success", "finished samples by finish reason",
                               labels=["finished_reason"])
    for reason, value in (("stop", s.finished_stop), ("length", s.finished_length), ("abort", s.finished_abort)):
        done.add_metric([reason], float(value))
    yield done


def _histogram(name: str, doc: str, h: Histogram, labels: tuple[list[str], list[str]] = ([], [])
               ) -> Metric:
    buckets, cumulative = [], 0
    for bound, count in zip([*map(floatToGoString, h.bounds), "+Inf"], h.counts):
        cumulative += count
        buckets.append((bound, float(cumulative)))
    family = HistogramMetricFamily(name, doc, labels=labels[0])
    family.add_metric(labels[1], buckets, h.total)
    return family


# -- vLLM's names -------------------------------------------------------------------------


def _vllm_metrics(s: EngineStats) -> Iterator[Metric]:
    """Every vLLM series this engine can fill, from the scheduler's figures."""
    labels = (["model_name", "engine"], [s.model_name, ENGINE])
    yield from _vllm_gauges(s, labels)
    yield _cache_config_info(s)
    yield from _vllm_counters(s, labels)
    yield from _vllm_histograms(s, labels)


def _vllm_gauges(s: EngineStats, labels: tuple[list[str], list[str]]) -> Iterator[Metric]:
    names, values = labels
    for name, doc, value in (
        ("num_requests_running", "Number of requests in model execution batches.", s.running),
        ("num_requests_waiting", "Number of requests waiting to be processed.", s.waiting),
        ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage),
        ("gpu_cache_usage_perc", ("KV-cache usage. DEPRECATED alias of "
         "vllm:kv_cache_usage_perc, kept for gateways that default to it."), s.kv_usage),
    ):
        g = GaugeMetricFamily(VLLM + name, doc, labels=names)
        g.add_metric(values, float(value))
        yield g
    g = GaugeMetricFamily(VLLM + "num_requests_waiting_by_reason",
                          "Number of waiting requests by reason (capacity: waiting for room; "
                          "deferred: a structured-output grammar still compiling).",
                          labels=[*names, "reason"])
    g.add_metric([*values, "capacity"], float(max(0, s.waiting - s.waiting_deferred)))
    g.add_metric([*values, "deferred"], float(s.waiting_deferred))
    yield g
    g = GaugeMetricFamily(VLLM + "engine_sleep_state", "Engine sleep state; pagoda never "
                          "sleeps: awake = 1.", labels=[*names, "sleep_state"])
    for state, value in (("awake", 1.0), ("weights_offloaded", 0.0), ("discard_all", 0.0)):
        g.add_metric([*values, state], value)
    yield g


def _vllm_counters(s: EngineStats, labels: tuple[list[str], list[str]]) -> Iterator[Metric]:
    names, values = labels

    def counter(name: str, doc: str, by: str = "", **series: float) -> Metric:
        """One counter; with ``by``, one series per keyword (label ``by`` = the key)."""
        c = CounterMetricFamily(VLLM + name, doc, labels=names + ([by] if by else []))
        for key, value in series.items():
            c.add_metric(values + ([key] if by else []), float(value))
        return c

    for prefix in ("", "gpu_"):  # gpu_*: the names before vLLM 0.9, still read by some
        yield counter(prefix + "prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      value=s.prefix_cache_queries)
        yield counter(prefix + "prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.",
                      value=s.prefix_cache_hits)
    yield counter("num_preemptions", "Cumulative number of preemption from the engine.",
                  value=s.num_preemptions)
    yield from _vllm_token_counters(s, counter)
    finished = {"stop": s.finished_stop, "length": s.finished_length, "abort": s.finished_abort}
    yield counter("request_success", "Count of successfully processed requests.",
                  by="finished_reason", **{r: finished.get(r, 0) for r in VLLM_FINISH_REASONS})


def _vllm_histograms(s: EngineStats, labels: tuple[list[str], list[str]]) -> Iterator[Metric]:
    for name, doc, hist in (
        ("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
         s.time_to_first_token),
        ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
         s.inter_token_latency),
        ("time_per_output_token_seconds", ("Histogram of time per output token in seconds. "
         "DEPRECATED alias of vllm:inter_token_latency_seconds."), s.inter_token_latency),
        ("request_time_per_output_token_seconds",
         "Histogram of time_per_output_token_seconds per request.",
         s.request_time_per_output_token),
        ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
         s.e2e_latency),
        ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
         s.queue_time),
        ("request_inference_time_seconds",
         "Histogram of time spent in RUNNING phase for request.", s.inference_time),
        ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
         s.prefill_time),
        ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
         s.decode_time),
        ("request_prompt_tokens", "Number of prefill tokens processed.", s.request_prompt_tokens),
        ("request_generation_tokens", "Number of generation tokens processed.",
         s.request_generation_tokens),
        ("request_max_num_generation_tokens",
         "Histogram of maximum number of requested generation tokens.",
         s.request_max_num_generation_tokens),
        ("request_params_n", "Histogram of the n request parameter.", s.request_params_n),
        ("request_params_max_tokens", "Histogram of the max_tokens request parameter.",
         s.request_params_max_tokens),
        ("request_prefill_kv_computed_tokens", ("Histogram of new KV tokens computed during "
         "prefill (excluding cached tokens)."), s.request_prefill_kv_computed_tokens),
        ("iteration_tokens_total", "Histogram of number of tokens per engine_step.",
         s.iteration_tokens),
    ):
        yield _histogram(VLLM + name, doc, hist, labels)


def _vllm_token_counters(s: EngineStats, counter: Callable[..., Metric]) -> Iterator[Metric]:
    computed, cached = s.prompt_tokens_computed, s.prompt_tokens_cached
    yield counter("prompt_tokens", "Number of prefill tokens processed.", value=computed + cached)
    yield counter("prompt_tokens_by_source", "Number of prompt tokens by source.", by="source",
                  local_compute=computed, local_cache_hit=cached, external_kv_transfer=0)
    yield counter("prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
                  value=cached)
    yield counter("prompt_tokens_recomputed", "Number of cached prompt tokens recomputed "
                  "(none here: the prompt's last block is never looked up).", value=0)
    yield counter("generation_tokens", "Number of generation tokens processed.",
                  value=s.generation_tokens)


def _cache_config_info(s: EngineStats) -> Metric:
    """vLLM's info gauge (value 1) of its CacheConfig, as labels; no model_name, as vLLM."""
    info = {
        "engine": ENGINE,
        "block_size": str(s.block_size),
        "num_gpu_blocks": str(s.num_kv_blocks),  # the engine's KV pool, on whatever device
        "num_cpu_blocks": "None",
        "kv_cache_size_tokens": str(s.num_kv_blocks * s.block_size),
        "enable_prefix_caching": str(s.enable_prefix_caching),
        "prefix_caching_hash_algo": "pagoda_sha256_64",  # block_manager.hash_block
        "cache_dtype": s.cache_dtype or "auto",
    }
    g = GaugeMetricFamily(VLLM + "cache_config_info", "Information of the LLMEngine CacheConfig",
                          labels=list(info))
    g.add_metric(list(info.values()), 1.0)
    return g
