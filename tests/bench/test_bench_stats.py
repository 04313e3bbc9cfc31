"""pagoda.bench.stats, roofline and the /metrics parser: definitions on known samples."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest

from pagoda.bench.report import build_report, format_text
from pagoda.bench.roofline import (
    ceiling,
    count_parameters,
    matmul_parameters,
    step_breakdown,
)
from pagoda.bench.runner_online import parse_prometheus
from pagoda.bench.stats import (
    RequestRecord,
    distribution,
    percentile,
    summarize,
    throughput_over_time,
)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentile_matches_numpy(n: int) -> None:
    rng = random.Random(n)
    values = [rng.expovariate(3.0) for _ in range(n)]
    for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12)


def test_percentile_edges() -> None:
    assert math.isnan(percentile([], 50))
    assert percentile([4.0, 1.0, 2.0, 3.0], 50) == 2.5  # sorts its input
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    d = distribution([1.0, 2.0, 3.0, 4.0, 5.0])
    assert d == {"count": 5, "mean": 3.0, "p50": 3.0, "p90": pytest.approx(4.6), "p99": pytest.approx(4.96)}


def test_request_record_definitions() -> None:
    rec = RequestRecord(prompt_len=10, output_len=5, start=1.0)
    for t, n in ((1.5, 1), (1.7, 1), (1.7, 0), (2.0, 2), (2.1, 1)):  # an empty delta is no token
        rec.add(t, n)
    assert rec.num_output_tokens == 5 and rec.ok
    assert rec.ttft == pytest.approx(0.5)
    assert rec.e2e == pytest.approx(1.1)
    assert rec.tpot == pytest.approx((1.1 - 0.5) / 4)  # (e2e - ttft) / (tokens - 1)
    assert rec.itls == pytest.approx([0.2, 0.3, 0.1])  # per token-carrying delta
    one = RequestRecord(3, 1, start=0.0, chunks=[(0.4, 1)])
    assert one.tpot is None and one.itls == [] and one.ttft == one.e2e == 0.4
    assert not RequestRecord(3, 1, error="boom").ok


def test_summarize_known_run() -> None:
    a = RequestRecord(100, 3, start=0.0, chunks=[(1.0, 1), (1.5, 1), (2.0, 1)])
    b = RequestRecord(50, 2, start=1.0, chunks=[(2.0, 1), (4.0, 1)])
    failed = RequestRecord(70, 4, start=0.5, error="HTTP 503")
    s = summarize([a, b, failed])
    assert (s["num_requests"], s["num_completed"], s["num_failed"]) == (3, 2, 1)
    assert s["duration_s"] == 4.0  # first send to last delta
    assert (s["prompt_tokens"], s["output_tokens"]) == (150, 5)
    assert s["output_tok_s"] == 5 / 4 and s["total_tok_s"] == 155 / 4 and s["requests_s"] == 0.5
    assert s["mean_in_flight"] == (2.0 + 3.0) / 4
    assert s["ttft_s"]["p50"] == 1.0 and s["ttft_s"]["count"] == 2
    assert s["tpot_s"]["mean"] == pytest.approx((0.5 + 2.0) / 2)
    assert s["itl_s"]["count"] == 3 and s["e2e_s"]["p50"] == 2.5


def test_report_puts_pagoda_beside_vllm_start_included() -> None:
    """The vLLM comparison: throughput, batch-1 latencies and engine start-up, each as
    pagoda / vLLM, and the text prints both engines' figures."""
    run = [RequestRecord(10, 4, start=0.0, chunks=[(1.0, 1), (2.0, 3)])]
    vllm = {"output_tok_s": 1.0, "bs1_ttft_s": 0.04, "bs1_tpot_s": 0.01, "start_s": 60.0,
            "token_ids": [[1, 2]]}
    scheduler = {"kv_usage_peak": 0.1, "num_preemptions": 0, "prefix_cache_hits": 0,
                 "prefix_cache_queries": 10, "prefix_cache_hit_rate": 0.0}
    report = build_report({"mode": "offline", "model": "m"}, run, scheduler, vllm=vllm,
                          bs1={"ttft_s": 0.01, "tpot_s": 0.005}, start_s=6.0)
    assert report["pagoda"]["start_s"] == 6.0
    assert "token_ids" not in report["baseline_vllm"]
    vs = report["comparison_vllm"]
    assert vs["output_tok_s_ratio"] == 2.0 and vs["start_ratio"] == pytest.approx(0.1)
    assert vs["bs1_ttft_ratio"] == pytest.approx(0.25) and vs["bs1_tpot_ratio"] == pytest.approx(0.5)
    text = format_text(report)
    assert "vLLM CPU:" in text and "start 60.0 s" in text
    assert "TPOT 5.0 ms, start 6.0 s" in text  # pagoda's line
    assert build_report({}, run, {}, vllm=vllm)["comparison_vllm"]["start_ratio"] is None


def test_throughput_over_time_conserves_tokens() -> None:
    recs = [RequestRecord(1, 3, start=0.0, chunks=[(0.1, 1), (2.2, 1), (3.9, 1)]),
            RequestRecord(1, 2, start=0.0, chunks=[(1.0, 2)])]
    t, rate = throughput_over_time(recs, bin_s=1.0)
    assert t == [0.5, 1.5, 2.5, 3.5]
    assert rate == [1.0, 2.0, 1.0, 1.0]
    assert throughput_over_time([]) == ([], [])


def test_parse_prometheus() -> None:
    text = ("# HELP pagoda:num_preemptions_total preemptions\n# TYPE x counter\n"
            "pagoda:num_preemptions_total 3.0\npagoda:kv_cache_usage_perc 0.25\n"
            'pagoda:request_success_total{finished_reason="stop"} 7.0\nbroken line\n')
    m = parse_prometheus(text)
    assert m["pagoda:num_preemptions_total"] == 3.0 and m["pagoda:kv_cache_usage_perc"] == 0.25
    assert m['pagoda:request_success_total{finished_reason="stop"}'] == 7.0
    assert "broken" not in m


def test_roofline_ceiling_matches_hand_computation() -> None:
    # PERFORMANCE.md's mixed workload on SmolLM2: ~106 GFLOP/s, ~19 GB/s -> ~130 output tok/s
    machine = {"matmul_flops": 106e9, "mem_read_bytes_s": 19e9}
    summary = {"prompt_tokens": 64 * 272, "output_tokens": 64 * 136, "mean_in_flight": 40.0,
               "output_tok_s": 65.0}
    r = ceiling(machine, 134_500_000, 4, summary)
    t_compute = 64 * (272 + 136) * 2 * 134.5e6 / 106e9
    assert r["bound"] == "compute"
    assert r["ceiling_output_tok_s"] == pytest.approx(64 * 136 / t_compute)
    assert 120 < r["ceiling_output_tok_s"] < 140
    assert r["fraction"] == pytest.approx(65.0 / r["ceiling_output_tok_s"])
    assert r["decode_ceiling_bs1_tok_s"] == pytest.approx(19e9 / (134.5e6 * 4))  # memory-bound
    assert "2 * layer_params" in r["definition"]
    # one request at a time: each token a full weight read
    r1 = ceiling(machine, 134_500_000, 4, {**summary, "mean_in_flight": 1.0})
    assert r1["bound"] == "memory"
    # the per-token matmuls only: a prompt token skips the embedding (a lookup) and the
    # lm_head (sampled tokens only): SmolLM2's 134.5 M = 106.2 M in layers + 28.3 M tied
    rs = ceiling(machine, 134_500_000, 4, summary, 106_200_000, 28_300_000)
    t_split = 64 * (272 * 2 * 106.2e6 + 136 * 2 * (106.2e6 + 28.3e6)) / 106e9
    assert rs["ceiling_output_tok_s"] == pytest.approx(64 * 136 / t_split)
    assert rs["ceiling_output_tok_s"] > r["ceiling_output_tok_s"]
    assert (rs["layer_params"], rs["lm_head_params"]) == (106_200_000, 28_300_000)


def test_step_breakdown_puts_each_step_beside_its_own_roofline() -> None:
    """Hand-computed: 1 MFLOP/s, 1 MB/s, 100 params of 2 B (a weight read: 200 us), 80 in
    the layers and 20 in the lm_head, 10 B of K/V a token. A prefill step (A's whole
    4-token prompt, B's last 2 of 3 after a 1-token prefix hit), then two decode steps,
    B finished before the second."""
    from shared.protocol import NewRequest, RunningRequest, StepBatch
    from shared.sampling_params import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    log = [
        (StepBatch(0, [NewRequest(1, [5, 6, 7, 8], 4, greedy, [1], 0),
                       NewRequest(2, [5, 6, 9], 3, greedy, [2], 1)], [], [1, 2], [4, 2]), 1e-3),
        (StepBatch(1, [], [RunningRequest(1), RunningRequest(2)], [1, 2], [1, 1]), 5e-4),
        (StepBatch(2, [], [RunningRequest(1)], [1], [1], finished_request_ids=[2]), 4e-4),
    ]
    machine = {"matmul_flops": 1e6, "mem_read_bytes_s": 1e6}
    steps = step_breakdown(log, machine, 100, 2, 80, 20, 10)
    assert list(steps) == ["prefill", "decode 1-8 rows", "all"]
    pre, dec, everything = steps["prefill"], steps["decode 1-8 rows"], steps["all"]
    # 6 tokens through the layers, both rows sampled: 1040 FLOP = 1.04 ms > one weight read
    assert pre["steps"] == 1 and pre["seconds"] == pytest.approx(1e-3)
    assert pre["roofline_s"] == pytest.approx(1.04e-3)
    assert pre["kv_read_s"] == pytest.approx((4 + 3) * 10 / 1e6)  # contexts after the step
    # 2 rows (400 us of matmuls), then 1 row (200 us, as a weight read)
    assert dec["steps"] == 2 and dec["seconds"] == pytest.approx(9e-4)
    assert dec["roofline_s"] == pytest.approx(4e-4 + 2e-4)
    assert dec["kv_read_s"] == pytest.approx((5 + 4 + 6) * 10 / 1e6)
    assert everything["steps"] == 3
    assert everything["roofline_s"] == pytest.approx(pre["roofline_s"] + dec["roofline_s"])
    assert dec["share"] == pytest.approx(6e-4 / 9e-4)
    assert dec["share_with_kv"] == pytest.approx((6e-4 + 1.5e-4) / 9e-4)


def test_count_parameters(tiny_llama_dir: Path) -> None:
    from support.checkpoints import load_hf

    assert count_parameters(tiny_llama_dir) == sum(p.numel() for p in load_hf(tiny_llama_dir).parameters())


def test_matmul_parameters_leave_out_the_embedding(tiny_llama_dir: Path, smollm2_dir: Path) -> None:
    from support.checkpoints import load_hf

    for model_dir in (tiny_llama_dir, smollm2_dir):  # separate lm_head; tied (SmolLM2)
        hf = load_hf(model_dir)
        layers = sum(p.numel() for n, p in hf.named_parameters()
                     if "embed_tokens" not in n and "lm_head" not in n)
        head = hf.config.vocab_size * hf.config.hidden_size
        assert matmul_parameters(model_dir) == (layers, head)
