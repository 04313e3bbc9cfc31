"""/metrics with 2 frontends on one HTTP port: it parses with prometheus_client's parser,
carries every vLLM series a gateway may read (vLLM's names, types and labels), and the
scheduler-side figures, which every frontend serves, move as requests complete and agree
whichever frontend answers the scrape. The same stack publishes vLLM-format KV events."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from services.scheduler.block_manager import hash_block
from support.live_stack import LiveStack, serving

pytestmark = pytest.mark.slow
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
TOPIC = "kv-events"
NUM_KV_BLOCKS, BLOCK_SIZE = 256, 16

# Every series of vLLM's /metrics that pagoda fills, as sample names in the text format.
# From vLLM's PrometheusStatLogger (vllm/v1/metrics/loggers.py, vLLM 0.2x) and the list
# its own server test checks (tests/entrypoints/openai/test_metrics.py, EXPECTED_METRICS_V1,
# including the deprecated names it lists in HIDDEN_DEPRECATED_METRICS, which gateways
# still default to). Left out, with no meaning here: LoRA (vllm:lora_requests_info),
# multi-modal and KV-connector caches (vllm:mm_cache_*, vllm:external_prefix_cache_*),
# speculative decoding (vllm:spec_decode_*), opt-in residency and NaN metrics
# (vllm:kv_block_*_seconds, vllm:corrupted_requests).
HISTOGRAMS = [
    "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds", "vllm:request_time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens", "vllm:request_max_num_generation_tokens",
    "vllm:request_params_n", "vllm:request_params_max_tokens",
    "vllm:request_prefill_kv_computed_tokens", "vllm:iteration_tokens_total",
]
VLLM_SERIES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:num_requests_waiting_by_reason", "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc", "vllm:engine_sleep_state",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
    "vllm:prompt_tokens_by_source_total", "vllm:prompt_tokens_cached_total",
    "vllm:prompt_tokens_recomputed_total", "vllm:generation_tokens_total",
    "vllm:request_success_total",
    *[name + suffix for name in HISTOGRAMS for suffix in ("_sum", "_bucket", "_count")],
]
INFO = "vllm:cache_config_info"  # labels: the cache config, and engine (no model_name)


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    kv_events = tmp_path_factory.mktemp("kv") / "kv.sock"
    with serving(smollm2_dir, tmp_path_factory.mktemp("metrics") / "serve.log", 2,
                 "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-model-len", "1024",
                 "--kv-events-endpoint", f"ipc://{kv_events}", "--kv-events-topic", TOPIC) as s:
        s.scheduler["kv_events"] = f"ipc://{kv_events}"
        yield s


def scrape(stack: LiveStack) -> tuple[str, Samples]:
    """(the answering frontend's id, every sample) of one scrape."""
    # a fresh connection per scrape, so SO_REUSEPORT can hand it to either frontend
    text = httpx.get(stack.http.removesuffix("/v1") + "/metrics", headers={"Connection": "close"}).text
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    frontend = next(dict(k[1])["frontend_id"] for k in samples if k[0] == "pagoda:frontend_info")
    return frontend, samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def served_model(stack: LiveStack) -> str:
    return str(httpx.get(f"{stack.http}/models").json()["data"][0]["id"])


def complete(stack: LiveStack, prompt: str, max_tokens: int) -> int:
    """One greedy completion of exactly max_tokens tokens; its prompt's token count."""
    r = httpx.post(f"{stack.http}/completions", timeout=120, json={
        "model": served_model(stack), "prompt": prompt, "max_tokens": max_tokens,
        "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == max_tokens
    return int(r.json()["usage"]["prompt_tokens"])


def scrape_both(stack: LiveStack, ready: Any) -> tuple[Samples, Samples]:
    """A scrape from each frontend once ``ready(samples)`` holds on it."""
    seen: dict[str, Samples] = {}
    deadline = time.monotonic() + 60
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"scrapes reached only {sorted(seen)}"
        frontend, samples = scrape(stack)
        if ready(samples):
            seen[frontend] = samples
        else:
            time.sleep(0.1)  # stats refresh with the ~1 s heartbeat; poll, do not guess
    a, b = seen.values()
    return a, b


def test_counters_move_and_agree_on_both_frontends(stack: LiveStack) -> None:
    model = {"model_name": served_model(stack), "engine": "0"}
    _, before = scrape(stack)
    n, max_tokens = 3, 5
    prompt_tokens = [complete(stack, f"Count to {i + 3}:", max_tokens) for i in range(n)]
    want_tokens = value(before, "pagoda:generation_tokens_total") + n * max_tokens
    want_done = value(before, "pagoda:request_success_total", finished_reason="length") + n
    a, b = scrape_both(stack, lambda s: (
        value(s, "pagoda:generation_tokens_total") == want_tokens
        and value(s, "pagoda:request_success_total", finished_reason="length") == want_done))
    for name in ("pagoda:prompt_tokens_total", "pagoda:time_to_first_token_seconds_count",
                 "pagoda:e2e_request_latency_seconds_count", "pagoda:request_queue_time_seconds_count"):
        assert value(a, name) == value(b, name) > value(before, name), name
    assert value(a, "pagoda:time_to_first_token_seconds_count") - value(
        before, "pagoda:time_to_first_token_seconds_count") == n
    assert value(a, "pagoda:inter_token_latency_seconds_count") - value(
        before, "pagoda:inter_token_latency_seconds_count") == n * (max_tokens - 1)
    assert value(a, "pagoda:num_requests_running") == 0 and value(a, "pagoda:kv_cache_usage_perc") == 0
    assert value(a, "pagoda:engine_healthy") == 1

    # vLLM's names: the same figures, with vLLM's definitions, on both frontends
    vllm = [key for key in a if key[0].startswith("vllm:")]
    assert vllm and all(a[key] == b.get(key) for key in vllm)

    def moved(name: str, **labels: str) -> float:
        return value(a, name, **model, **labels) - value(before, name, **model, **labels)

    generated, prompts = n * max_tokens, sum(prompt_tokens)
    assert moved("vllm:request_success_total", finished_reason="length") == n
    assert moved("vllm:generation_tokens_total") == generated
    assert moved("vllm:prompt_tokens_total") == prompts
    assert moved("vllm:prompt_tokens_by_source_total", source="local_compute") + moved(
        "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == prompts
    assert moved("vllm:request_prompt_tokens_sum") == prompts
    assert moved("vllm:request_generation_tokens_sum") == generated
    assert moved("vllm:request_params_max_tokens_sum") == generated
    assert moved("vllm:request_params_n_sum") == n
    # one request at a time: a step per token, its first also carrying the prompt
    assert moved("vllm:iteration_tokens_total_count") == generated
    assert moved("vllm:iteration_tokens_total_sum") == prompts + generated
    assert moved("vllm:inter_token_latency_seconds_count") == n * (max_tokens - 1)
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:request_prompt_tokens",
                 "vllm:request_max_num_generation_tokens"):
        assert moved(name + "_count") == n, name
        assert value(a, name + "_bucket", **model, le="+Inf") == value(a, name + "_count", **model)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert value(a, name, **model) == 0, name  # what the inference gateway reads


def test_every_vllm_series_with_its_labels(stack: LiveStack) -> None:
    complete(stack, "Hello", 2)  # so no histogram is empty
    model_name = served_model(stack)
    _, samples = scrape(stack)
    names = {name for name, _ in samples}
    missing = [name for name in [*VLLM_SERIES, INFO] if name not in names]
    assert not missing, missing
    for name, labels in samples:
        if name.startswith("vllm:") and name != INFO:
            assert ("model_name", model_name) in labels and ("engine", "0") in labels, name
    (info, one), = [(dict(labels), v) for (name, labels), v in samples.items() if name == INFO]
    assert one == 1 and info["engine"] == "0" and info["enable_prefix_caching"] == "True"
    assert info["cache_dtype"] == "auto"  # the --kv-cache-dtype setting, as vLLM labels it
    assert (info["block_size"], info["num_gpu_blocks"]) == (str(BLOCK_SIZE), str(NUM_KV_BLOCKS))
    reasons = {dict(labels)["finished_reason"] for name, labels in samples
               if name == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}


def test_kv_events_reach_a_subscriber(stack: LiveStack) -> None:
    """A prompt of more than a block: the scheduler publishes its full blocks as
    vLLM's BlockStored, on the topic, with hashes a subscriber can recompute."""
    ctx: zmq.Context[Any] = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(stack.scheduler["kv_events"])
    try:
        stored: list[dict[str, Any]] = []
        deadline = time.monotonic() + 120
        attempt = 0
        while not stored:  # the subscription reaches the publisher a little after connect
            assert time.monotonic() < deadline, "no BlockStored event arrived"
            attempt += 1
            complete(stack, f"Attempt {attempt}: " + "the quick brown fox jumps " * 8, 2)
            while sub.poll(2000, zmq.POLLIN):
                topic, seq, payload = sub.recv_multipart()
                assert topic == TOPIC.encode() and len(seq) == 8
                ts, events, rank = msgspec.msgpack.decode(payload)
                assert isinstance(ts, float) and rank == 0
                stored += [e for e in events if e["type"] == "BlockStored"]
        for event in stored:
            assert event["block_size"] == BLOCK_SIZE and event["medium"] == "GPU"
            assert len(event["token_ids"]) == BLOCK_SIZE * len(event["block_hashes"])
            parent = event["parent_block_hash"]
            for i, h in enumerate(event["block_hashes"]):
                parent = hash_block(parent, tuple(event["token_ids"][i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]))
                assert parent == h
    finally:
        sub.close(linger=0)
        ctx.term()
    _, samples = scrape(stack)
    assert value(samples, "pagoda:kv_events_published_total") > 0
