"""/metrics with 2 frontends on one HTTP port: it parses with prometheus_client's parser,
and the scheduler-side figures, which every frontend serves, move as requests complete
and agree whichever frontend answers the scrape."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.live_stack import LiveStack, serving

pytestmark = pytest.mark.slow
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def stack(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveStack]:
    with serving(smollm2_dir, tmp_path_factory.mktemp("metrics") / "serve.log", 2,
                    "--num-kv-blocks", "256", "--max-model-len", "1024") as s:
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


def test_counters_move_and_agree_on_both_frontends(stack: LiveStack) -> None:
    _, before = scrape(stack)
    n, max_tokens = 3, 5
    for i in range(n):
        r = httpx.post(f"{stack.http}/completions", timeout=120, json={
            "model": "x", "prompt": f"Count to {i + 3}:", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code in (200, 404), r.text
        if r.status_code == 404:  # the model id is the --model value as given
            model = httpx.get(f"{stack.http}/models").json()["data"][0]["id"]
            r = httpx.post(f"{stack.http}/completions", timeout=120, json={
                "model": model, "prompt": f"Count to {i + 3}:", "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
    want_tokens = value(before, "pagoda:generation_tokens_total") + n * max_tokens
    want_done = value(before, "pagoda:request_success_total", finished_reason="length") + n
    seen: dict[str, Samples] = {}
    deadline = time.monotonic() + 60
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"scrapes reached only {sorted(seen)}"
        frontend, samples = scrape(stack)
        if (value(samples, "pagoda:generation_tokens_total") == want_tokens
                and value(samples, "pagoda:request_success_total", finished_reason="length") == want_done):
            seen[frontend] = samples
        else:
            time.sleep(0.1)  # stats refresh with the ~1 s heartbeat; poll, do not guess
    a, b = seen.values()
    for name in ("pagoda:prompt_tokens_total", "pagoda:time_to_first_token_seconds_count",
                 "pagoda:e2e_request_latency_seconds_count", "pagoda:request_queue_time_seconds_count"):
        assert value(a, name) == value(b, name) > value(before, name), name
    assert value(a, "pagoda:time_to_first_token_seconds_count") - value(
        before, "pagoda:time_to_first_token_seconds_count") == n
    assert value(a, "pagoda:inter_token_latency_seconds_count") - value(
        before, "pagoda:inter_token_latency_seconds_count") == n * (max_tokens - 1)
    assert value(a, "pagoda:num_requests_running") == 0 and value(a, "pagoda:kv_cache_usage_perc") == 0
    assert value(a, "pagoda:engine_healthy") == 1
