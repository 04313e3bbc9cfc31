"""Online mode: requests to a running server, over HTTP or the native ZMQ API.

One asyncio driver (``run_online``) sends each request at its arrival time (Poisson,
or all at once) while at most ``max_concurrency`` are in flight, and a sender streams
it, stamping each delta on arrival:

- ``HttpSender``: ``POST /v1/completions`` with ``stream: true`` (token-id prompt,
  ``ignore_eos``, greedy) through aiohttp, reading the SSE events. A text chunk counts as
  one token; the final usage chunk (``stream_options.include_usage``) gives the true
  total, and any tokens the stream did not show as text are put on the last delta. So
  TPOT is exact, and ITL is per chunk (as in vLLM's benchmark).
- ``ZmqSender``: ``pagoda.client.AsyncClient.stream`` spread over the frontends; every
  delta carries its token ids, so counts are exact.

The scheduler's statistics come from the Prometheus text at ``/metrics``: scraped before
and after the run (counter differences) and about twice a second during it (KV peak).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from tqdm import tqdm

from pagoda.bench.runner_offline import scheduler_figures
from pagoda.bench.stats import RequestRecord
from pagoda.bench.workload import Workload, arrival_times, warmup_workload

# send request (index, prompt ids, output length, record, clock), filling the record's deltas
Send = Callable[[int, list[int], int, RequestRecord, Callable[[], float]], Awaitable[None]]


async def run_online(send: Send, work: Workload, request_rate: float = float("inf"),
                     max_concurrency: int | None = None, seed: int = 0,
                     progress: bool = True, label: str = "pagoda online") -> list[RequestRecord]:
    arrivals = arrival_times(len(work), request_rate, seed)
    gate = asyncio.Semaphore(max_concurrency or len(work))
    records = [RequestRecord(len(p), n) for p, n in zip(work.prompts, work.output_lens)]
    bar = tqdm(total=len(work), desc=label, unit="req", disable=not progress)
    t0 = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - t0

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, arrivals[i] - clock()))
        async with gate:
            records[i].start = clock()
            try:
                await send(i, work.prompts[i], work.output_lens[i], records[i], clock)
            # any failure of one request is counted in its record, not fatal to the run
            except Exception as e:  # noqa: BLE001
                records[i].error = f"{type(e).__name__}: {e}"
            bar.update(1)

    try:
        await asyncio.gather(*(one(i) for i in range(len(work))))
    finally:
        bar.close()
    return records


class HttpSender:
    """Streams completions from an OpenAI-compatible server at ``base_url`` (…/v1).

    Through aiohttp, as vLLM's serving benchmark does: the client shares the machine with
    the server it measures, and per streamed token it takes 26-33 us of CPU where httpx
    took 46-74 (a 2-core Zen 4, 64 streams of 128-256 tokens from ``pagoda serve``); the
    same runs finished 1-5 % sooner. The session is made in the event loop of the first
    request, and closed by ``aclose`` in the same loop.
    """

    def __init__(self, base_url: str, model: str | None = None) -> None:
        self.url = base_url.rstrip("/") + "/completions"
        self.model = model
        self._session: Any = None  # an aiohttp.ClientSession from the first request on

    def _client(self) -> Any:
        if self._session is None:
            import aiohttp

            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),  # no cap: max_concurrency gates
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=30.0),
                trust_env=False)  # a benchmark of a local server must not go through a proxy
        return self._session

    async def __call__(self, i: int, prompt: list[int], output_len: int, rec: RequestRecord,
                       clock: Callable[[], float]) -> None:
        body: dict[str, Any] = {
            "prompt": prompt, "max_tokens": output_len,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.model:
            body["model"] = self.model
        total: int | None = None
        async with self._client().post(self.url, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:200]!r}")
            async for event in _sse_events(response.content.iter_any()):
                t = clock()
                if event.get("usage") and not event.get("choices"):
                    total = int(event["usage"]["completion_tokens"])
                    continue
                choice = event["choices"][0]
                if choice.get("text") or choice.get("finish_reason") is not None:
                    rec.add(t, 1 if choice.get("text") else 0)
        if total is not None and rec.chunks and total != rec.num_output_tokens:
            t_last, n_last = rec.chunks[-1]
            rec.chunks[-1] = (t_last, max(0, n_last + total - rec.num_output_tokens))

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def _sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an SSE body arriving in arbitrary pieces; ends at ``[DONE]``."""
    pending = b""
    async for chunk in chunks:
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            yield event


class ZmqSender:
    """Streams from frontends' native APIs, request i through frontend i mod N."""

    def __init__(self, addresses: Sequence[str]) -> None:
        from pagoda.client import AsyncClient

        self.clients = [AsyncClient(a, timeout=None) for a in addresses]

    async def __call__(self, i: int, prompt: list[int], output_len: int, rec: RequestRecord,
                       clock: Callable[[], float]) -> None:
        client = self.clients[i % len(self.clients)]
        async with client.stream(prompt, max_tokens=output_len,
                                 temperature=0.0, ignore_eos=True) as stream:
            async for out in stream:
                rec.add(clock(), len(out.token_ids))

    async def aclose(self) -> None:
        for c in self.clients:
            await c.close()


# -- /metrics ---------------------------------------------------------------------------
def parse_prometheus(text: str) -> dict[str, float]:
    """``name{labels}`` -> value for every sample line (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


class MetricsWatcher:
    """Scrapes ``metrics_url`` before, during (KV peak) and after a run, through one HTTP
    session: a new client per scrape builds a new SSL context (~60 ms of CPU), and at two
    scrapes a second that took ~4 s of CPU from the engine under test."""

    def __init__(self, metrics_url: str | None, period_s: float = 0.5) -> None:
        self.url, self.period = metrics_url, period_s
        self.before: dict[str, float] = {}
        self.kv_peak: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._session: Any = None  # an aiohttp.ClientSession from start() to stop()

    async def _scrape(self) -> dict[str, float]:
        import aiohttp

        if self.url is None or self._session is None:
            return {}
        try:
            async with self._session.get(self.url) as response:
                return parse_prometheus(await response.text()) if response.status == 200 else {}
        except (TimeoutError, aiohttp.ClientError):
            return {}

    async def start(self) -> None:
        import aiohttp

        if self.url is not None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=10.0), trust_env=False)
        self.before = await self._scrape()
        self._task = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        while True:
            kv = (await self._scrape()).get("pagoda:kv_cache_usage_perc")
            if kv is not None:
                self.kv_peak = max(self.kv_peak or 0.0, kv)
            await asyncio.sleep(self.period)

    async def stop(self, num_output_tokens: int, wait_s: float = 5.0) -> dict[str, Any]:
        """The run's figures. Frontends refresh their view of the scheduler about once a
        second, so the final scrape waits (up to ``wait_s``) until the generated-token
        counter has counted the run's ``num_output_tokens``."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        key = "pagoda:generation_tokens_total"
        deadline = time.monotonic() + wait_s
        try:
            after = await self._scrape()
            while (key in after and after[key] - self.before.get(key, 0.0) < num_output_tokens
                   and time.monotonic() < deadline):
                await asyncio.sleep(0.25)
                after = await self._scrape()
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None

        def delta(name: str) -> float | None:
            key = "pagoda:" + name
            return after[key] - self.before.get(key, 0.0) if key in after else None

        return scheduler_figures(self.kv_peak, delta("num_preemptions_total"),
                                 delta("prefix_cache_queries_total"), delta("prefix_cache_hits_total"))


async def bench_online(make_sender: Callable[[], Any], work: Workload, metrics_url: str | None,
                       request_rate: float, max_concurrency: int | None, seed: int,
                       progress: bool, label: str) -> tuple[list[RequestRecord], dict[str, Any]]:
    """Warm-up (two short requests, other prompts), then the run with /metrics watched around it."""
    sender = make_sender()
    try:
        await run_online(sender, warmup_workload(work), progress=False)
        if metrics_url is not None:
            await asyncio.sleep(1.5)  # one heartbeat: the "before" scrape counts the warm-up
        watcher = MetricsWatcher(metrics_url)
        await watcher.start()
        records = await run_online(sender, work, request_rate, max_concurrency, seed, progress, label)
        return records, await watcher.stop(sum(r.num_output_tokens for r in records))
    finally:
        await sender.aclose()
