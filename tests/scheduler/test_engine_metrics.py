"""EngineMetrics: histograms and counters the scheduler core keeps while it runs with a
fabricated worker (timestamps from a fake clock), rendered by the frontend's
EngineStatsView and parsed back with prometheus_client."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.scheduler.metrics import HistogramAccumulator
from services.scheduler.scheduler import Scheduler, SchedulerConfig
from services.tokenizer.engine_stats import EngineStatsView
from shared.codec import MalformedFrameCounter, decode, encode
from shared.sampling_params import SamplingParams
from support.fake_worker import FakeWorker


def test_histogram_buckets_match_prometheus_le_semantics() -> None:
    h = HistogramAccumulator([0.1, 1.0])
    for v in (0.05, 0.1, 0.5, 1.0, 3.0, -1.0):
        h.observe(v)
    assert h.counts == [3, 2, 1]  # -1 clamps to 0; le=0.1 holds 0, 0.05, 0.1
    assert h.count == 6 and abs(h.total - 4.65) < 1e-9


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_counters_move_and_render_parses() -> None:
    clock = [100.0]
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, vocab_size=1000),
                      clock=lambda: clock[0])
    worker = FakeWorker(4, 1000)
    for i, n in enumerate((1, 2)):
        sched.add_request(f"r{i}", [5, 6, 7, 8, 9], SamplingParams(n=n, max_tokens=3, ignore_eos=True),
                          arrival_time=99.0)
    sched.add_request("gone", [5, 6], SamplingParams(max_tokens=3), arrival_time=99.5)
    sched.abort_request(["gone"])  # never ran: counted as aborted, no token figures
    first = sched.requests["r0"][0]
    while sched.has_unfinished_requests():
        clock[0] += 0.5
        batch = sched.schedule()
        clock[0] += 0.25  # the step's compute
        sched.update(batch, worker.execute(batch))
    # r0 was scheduled at 100.5, sampled at 100.75, 101.5, 102.25
    assert (first.arrival_time, first.first_scheduled_time) == (99.0, 100.5)
    assert (first.first_token_time, first.last_token_time) == (100.75, 102.25)
    counter = MalformedFrameCounter()
    counter.record("scheduler_frontend", "msgpack", b"\x00", "x")
    stats = decode(encode(sched.metrics.snapshot(sched.stats(), counter)))  # as on the wire
    assert stats.generation_tokens == 9 and stats.prompt_tokens == 12 and stats.finished_length == 3
    assert stats.finished_abort == 1 and stats.num_kv_blocks == 64
    assert stats.time_to_first_token.count == 3 and stats.inter_token_latency.count == 6
    assert stats.queue_time.count == 3 and stats.e2e_latency.count == 4
    # r0 and r1 child 0 wait 1.75 s for a first token; r1 child 1 starts a step later
    assert stats.time_to_first_token.total == 2 * 1.75 + 2.5
    assert stats.inter_token_latency.total == 6 * 0.75

    view = EngineStatsView("frontend-0", MalformedFrameCounter())
    assert view.health() == (False, "no answer from the scheduler yet")
    view.update(stats)
    assert view.health() == (True, "ok")
    body, ctype = view.render_metrics()
    assert ctype.startswith("text/plain")
    got = samples(body.decode())
    assert got[("pagoda:generation_tokens_total", ())] == 9
    assert got[("pagoda:request_success_total", (("finished_reason", "length"),))] == 3
    assert got[("pagoda:time_to_first_token_seconds_count", ())] == 3
    assert got[("pagoda:kv_cache_usage_perc", ())] == 0.0
    assert got[("pagoda:malformed_frames_total",
                (("process", "scheduler"), ("reason", "msgpack"), ("socket", "scheduler_frontend")))] == 1
    view.set_draining()
    assert view.health()[0] is False


def test_every_abort_path_counts_once_per_sequence() -> None:
    """A stop string ending one of n=4 samples (the frontend aborts that index), an
    explicit or disconnect abort of the rest, an abort racing a finish: each sequence
    counts once under its finish reason."""
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, vocab_size=1000))
    worker = FakeWorker(4, 1000)
    sched.add_request("r", [5, 6, 7, 8, 9], SamplingParams(n=4, max_tokens=50, ignore_eos=True))
    sched.add_request("w", [5, 6], SamplingParams(max_tokens=50))
    for _ in range(3):
        batch = sched.schedule()
        sched.update(batch, worker.execute(batch))
    assert len(sched.abort_request(["r"], index=2)) == 1  # the stop-string abort of sample 2
    assert sched.abort_request(["r"], index=2) == []  # a duplicate is not counted again
    assert len(sched.abort_request(["r", "w"])) == 4  # the client went away
    assert sched.abort_request(["r", "w"]) == []
    stats = sched.metrics.snapshot(sched.stats(), MalformedFrameCounter())
    assert (stats.finished_abort, stats.finished_stop, stats.finished_length) == (5, 0, 0)
    assert stats.e2e_latency.count == 5
