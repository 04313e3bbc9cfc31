"""EngineMetrics: histograms and counters from a scheduler run with a fabricated worker,
rendered by the frontend's EngineStatsView and parsed back with prometheus_client."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from services.scheduler.metrics import EngineMetrics, HistogramAccumulator
from services.scheduler.request import seq_id_of
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
    sched = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, vocab_size=1000))
    worker = FakeWorker(4, 1000)
    metrics = EngineMetrics()
    clock = [100.0]
    for i, n in enumerate((1, 2)):
        rid = f"r{i}"
        sched.add_request(rid, [5, 6, 7, 8, 9], SamplingParams(n=n, max_tokens=3, ignore_eos=True))
        metrics.on_add(rid, [seq_id_of(rid, k) for k in range(n)], arrival=99.0, num_prompt_tokens=5)
    while sched.has_unfinished_requests():
        clock[0] += 0.5
        batch = sched.schedule()
        metrics.on_step(batch, clock[0])
        metrics.on_outputs(sched.update(batch, worker.execute(batch)), clock[0])
    counter = MalformedFrameCounter()
    counter.record("scheduler_frontend", "msgpack", b"\x00", "x")
    stats = decode(encode(metrics.snapshot(sched.stats(), 64, counter)))  # as on the wire
    assert stats.generation_tokens == 9 and stats.prompt_tokens == 10 and stats.finished_length == 3
    assert stats.time_to_first_token.count == 3 and stats.inter_token_latency.count == 6
    assert stats.queue_time.count == 3 and stats.e2e_latency.count == 3

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
