"""From client-side timestamps to the benchmark's figures.

Every runner records, per request, when it was sent and when each streamed delta
arrived with how many tokens (``RequestRecord``); everything here derives from those
timestamps (seconds on one monotonic clock, the run's start at 0). Definitions, as
vLLM's ``benchmark_serving`` uses them:

- TTFT: first delta carrying a token, minus the send time.
- E2E latency: the last delta, minus the send time.
- TPOT (time per output token): ``(e2e - ttft) / (output_tokens - 1)``, one value per
  request with at least two output tokens.
- ITL (inter-token latency): the gaps between consecutive token-carrying deltas of one
  request, all requests pooled. A delta with k tokens counts as one gap (an HTTP
  stream may hold text back and send two tokens at once); offline and ZMQ deltas are
  one token each in steady decode.
- Throughput: tokens of completed requests over the wall time from the first send to
  the last delta; total = prompt + output tokens.

Percentiles interpolate linearly between order statistics (numpy's default method).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestRecord:
    prompt_len: int
    output_len: int  # tokens asked for
    start: float = 0.0  # when it was sent
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) per delta
    error: str | None = None

    def add(self, t: float, num_tokens: int) -> None:
        self.chunks.append((t, num_tokens))

    @property
    def ok(self) -> bool:
        return self.error is None and self.num_output_tokens > 0

    @property
    def num_output_tokens(self) -> int:
        return sum(n for _, n in self.chunks)

    @property
    def end(self) -> float:
        return self.chunks[-1][0] if self.chunks else self.start

    @property
    def ttft(self) -> float | None:
        first = next((t for t, n in self.chunks if n > 0), None)
        return None if first is None else first - self.start

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        ttft, n = self.ttft, self.num_output_tokens
        return None if ttft is None or n < 2 else (self.e2e - ttft) / (n - 1)

    @property
    def itls(self) -> list[float]:
        times = [t for t, n in self.chunks if n > 0]
        return [b - a for a, b in itertools.pairwise(times)]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation as ``numpy.percentile``."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> dict[str, float | int]:
    """mean and p50/p90/p99 (seconds), and the sample count."""
    out: dict[str, float | int] = {"count": len(values),
                                   "mean": sum(values) / len(values) if values else math.nan}
    for q in PERCENTILES:
        out[f"p{q:g}"] = percentile(values, q)
    return out


def summarize(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Throughput and latency figures of one run (see the module docstring)."""
    done = [r for r in records if r.ok]
    duration = (max(r.end for r in done) - min(r.start for r in records)) if done else 0.0
    prompt_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)

    def rate(x: float) -> float:
        return x / duration if duration > 0 else math.nan

    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tok_s": rate(output_tokens),
        "total_tok_s": rate(prompt_tokens + output_tokens),
        "requests_s": rate(len(done)),
        # time-weighted mean of requests in flight: the load the figures were taken at
        "mean_in_flight": rate(sum(r.e2e for r in done)),
        "ttft_s": distribution([t for r in done if (t := r.ttft) is not None]),
        "tpot_s": distribution([t for r in done if (t := r.tpot) is not None]),
        "itl_s": distribution([g for r in done for g in r.itls]),
        "e2e_s": distribution([r.e2e for r in done]),
    }


def throughput_over_time(records: Sequence[RequestRecord], bin_s: float | None = None
                         ) -> tuple[list[float], list[float]]:
    """(bin centres, output tokens/s in each bin) from delta arrivals: about 25 bins, none
    shorter than 0.5 s, so a bin spans several engine steps and the curve is not spiky."""
    chunks = [(t, n) for r in records for t, n in r.chunks if n > 0]
    if not chunks:
        return [], []
    t0 = min(r.start for r in records)
    span = max(t for t, _ in chunks) - t0
    width = bin_s if bin_s is not None else max(span / 25, 0.5)
    bins = [0.0] * (int(span / width) + 1)
    for t, n in chunks:
        bins[min(int((t - t0) / width), len(bins) - 1)] += n
    return [(i + 0.5) * width for i in range(len(bins))], [b / width for b in bins]


def record_lists(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """The raw samples behind the distributions, for the CDF plot."""
    done = [r for r in records if r.ok]
    return {
        "ttft_s": [t for r in done if (t := r.ttft) is not None],
        "tpot_s": [t for r in done if (t := r.tpot) is not None],
        "itl_s": [g for r in done for g in r.itls],
        "e2e_s": [r.e2e for r in done],
    }
