"""Offline mode: the in-process engine of ``pagoda.LLM``, driven step by step.

``LLM.generate`` hands back whole outputs; a benchmark needs each token's arrival, so
this runner drives the same ``EngineCore`` (``llm.engine``) itself: it adds a request
when its arrival time has come and fewer than ``max_concurrency`` are in flight, runs
one engine step, and stamps every sample's new tokens with the step's end. Between
steps it reads the scheduler's statistics (KV usage peak; preemption and prefix-cache
counters as differences over the run).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from tqdm import tqdm

from pagoda.bench.stats import RequestRecord
from pagoda.bench.workload import Workload, arrival_times, warmup_workload
from shared.sampling_params import SamplingParams


def greedy_exact(output_len: int) -> SamplingParams:
    """Greedy, exactly ``output_len`` tokens (EOS does not end the request)."""
    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)


BS1_OUTPUT = 128  # the batch-1 probe: a 128-token prompt, 128 output tokens


def bs1_probe(work: Workload, length: int = 128) -> list[int]:
    """The batch-1 probe's prompt: the workload's first prompt, repeated to ``length``."""
    first = work.prompts[0]
    return (first * (length // len(first) + 1))[:length]


def measure_bs1(llm: Any, prompt: list[int], output_len: int) -> dict[str, float]:
    """Batch-1 TTFT (a 1-token request) and TPOT (from a full one), medians of three, as
    the vLLM baseline measures them (vllm_runner.py)."""
    ttft, full = [], []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate([prompt], greedy_exact(1), use_tqdm=False)
        ttft.append(time.perf_counter() - t)
        t = time.perf_counter()
        llm.generate([prompt], greedy_exact(output_len), use_tqdm=False)
        full.append(time.perf_counter() - t)
    ttft_s = statistics.median(ttft)
    return {"ttft_s": ttft_s, "tpot_s": (statistics.median(full) - ttft_s) / (output_len - 1)}


def warm_up(llm: Any, work: Workload) -> None:
    """Two short requests first, so one-time costs (allocator, kernels) stay out of the run."""
    warm = warmup_workload(work)
    llm.generate(warm.prompts, [greedy_exact(n) for n in warm.output_lens], use_tqdm=False)


def run_offline(llm: Any, work: Workload, request_rate: float = float("inf"),
                max_concurrency: int | None = None, seed: int = 0,
                progress: bool = True) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Runs the workload; returns the per-request records and the scheduler figures."""
    engine = llm.engine
    arrivals = arrival_times(len(work), request_rate, seed)
    limit = max_concurrency or len(work)
    records = [RequestRecord(len(p), n) for p, n in zip(work.prompts, work.output_lens)]
    ids = {f"bench-{i}": i for i in range(len(work))}
    before = engine.stats()
    kv_peak, next_i, in_flight = 0.0, 0, 0
    bar = tqdm(total=len(work), desc="pagoda offline", unit="req", disable=not progress)
    t0 = time.perf_counter()
    try:
        while next_i < len(work) or engine.has_unfinished_requests():
            now = time.perf_counter() - t0
            while next_i < len(work) and arrivals[next_i] <= now and in_flight < limit:
                records[next_i].start = now
                engine.add_request(f"bench-{next_i}", work.prompts[next_i],
                                   greedy_exact(work.output_lens[next_i]))
                next_i, in_flight = next_i + 1, in_flight + 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, arrivals[next_i] - now))  # idle until the next arrival
                continue
            outputs = engine.step()
            t = time.perf_counter() - t0
            for out in outputs:
                rec = records[ids[out.request_id]]
                if out.new_token_ids or out.finished:
                    rec.add(t, len(out.new_token_ids))
                if out.finished:
                    in_flight -= 1
                    bar.update(1)
            kv_peak = max(kv_peak, engine.stats().kv_usage)
    except BaseException:
        engine.abort_request(list(ids))
        raise
    finally:
        bar.close()
    after = engine.stats()
    return records, scheduler_figures(
        kv_peak, after.num_preemptions - before.num_preemptions,
        after.prefix_cache_queries - before.prefix_cache_queries,
        after.prefix_cache_hits - before.prefix_cache_hits)


def scheduler_figures(kv_peak: float | None, preemptions: float | None, queries: float | None,
                      hits: float | None) -> dict[str, Any]:
    """The scheduler's statistics over the run, as the report shows them (None: unknown)."""
    return {
        "kv_usage_peak": kv_peak,
        "num_preemptions": preemptions,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": (hits / queries) if queries and hits is not None else None,
    }
