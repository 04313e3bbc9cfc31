"""Benchmark (not a test): the small-batch bf16 linear (``cpu_gemv``) beside oneDNN.

    python -m kernels.bench_gemv [--rows 1 2 4 8] [--rounds 25] [--set-mb 96] [--round-mb 192]

For each linear of SmolLM2-135M (hidden 576) at each row count M: the median time of
one call of ``cpu_gemv.linear_bf16`` on the plain weight and of oneDNN's linear on the
packed weight (``_reorder_linear_weight`` then ``_linear_pointwise``, as
``services/worker/layers/linear.py``), the weight-read bandwidth of each (N * K * 2
bytes per call) and their ratio (oneDNN time / ours: above 1, ours is faster). Each
measurement cycles through enough copies of the weights (``--set-mb``, beyond the 32 MB
L3) that every call reads its weights from DRAM, as in a real step, whose 270 MB of
weights go through the cache once. Rounds of the two (``--round-mb`` of weights each)
alternate, so both see the same machine; on a shared host its memory bandwidth can
change by 2x from one minute to the next, so compare the ratios of one run. The "whole
model step" line adds up 30 layers x (qkv, o, gate_up, down) and the lm_head; the first
line is the machine's read bandwidth for scale (torch sum of a 256 MB fp32 tensor). The
thread count is torch's (``--threads`` to set it).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import cpu_gemv

LAYERS = 30


@dataclass(frozen=True)
class Shape:
    name: str
    n: int  # output features
    k: int  # input features
    per_step: int  # calls per model step

    @property
    def weight_bytes(self) -> int:
        return self.n * self.k * 2


SHAPES = (
    Shape("qkv", 960, 576, LAYERS),
    Shape("o", 576, 576, LAYERS),
    Shape("gate_up", 3072, 576, LAYERS),
    Shape("down", 576, 1536, LAYERS),
    Shape("lm_head", 49152, 576, 1),
)


def read_bandwidth(rounds: int) -> float:  # bytes / s of torch's sum over a 256 MB tensor
    t = torch.ones(64 * 1024 * 1024)
    t.sum()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        t.sum()
        times.append(time.perf_counter() - start)
    return t.numel() * 4 / statistics.median(times)


def time_rounds(
    fns: list[Callable[[int], object]], copies: int, calls: int, rounds: int
) -> list[float]:  # median seconds per call of each fn (called with a copy index)
    """Rounds of `calls` calls of each fn in turn, cycling through the copies; the order
    of the fns rotates from one round to the next (the first of a round runs after
    another's last: no fn always follows the same one)."""
    per_call: list[list[float]] = [[] for _ in fns]
    for fn in fns:  # warm-up: first touch, the pool's threads, oneDNN's primitive cache
        for c in range(copies):
            fn(c)
    for r in range(rounds):
        for i in [*range(r % len(fns), len(fns)), *range(r % len(fns))]:
            fn = fns[i]
            start = time.perf_counter()
            for c in range(calls):
                fn(c % copies)
            per_call[i].append((time.perf_counter() - start) / calls)
    return [statistics.median(t) for t in per_call]


def bench_shape(shape: Shape, rows: list[int], rounds: int, set_bytes: int, round_bytes: int,
                gen: torch.Generator) -> dict[int, tuple[float, float]]:
    """{M: (ours, oneDNN) median seconds per call}."""
    copies = max(2, math.ceil(set_bytes / shape.weight_bytes))
    calls = max(copies, math.ceil(round_bytes / shape.weight_bytes))
    weights = [(torch.randn(shape.n, shape.k, generator=gen) * 0.05).bfloat16()
               for _ in range(copies)]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    result = {}
    for m in rows:
        x = torch.randn(m, shape.k, generator=gen).bfloat16()
        ours = cpu_gemv.linear_bf16(x, weights[0], None)
        ref = torch.ops.mkldnn._linear_pointwise(x, packed[0], None, "none", [], "")
        if not torch.allclose(ours.float(), ref.float(), rtol=2e-2, atol=2e-2):
            raise AssertionError(f"{shape.name} M={m}: cpu_gemv and oneDNN disagree")

        def run_ours(c: int, x: torch.Tensor = x) -> object:
            return cpu_gemv.linear_bf16(x, weights[c], None)

        def run_onednn(c: int, x: torch.Tensor = x) -> object:
            return torch.ops.mkldnn._linear_pointwise(x, packed[c], None, "none", [], "")

        t_ours, t_dnn = time_rounds([run_ours, run_onednn], copies, calls, rounds)
        result[m] = (t_ours, t_dnn)
    return result


def _row(label: str, nbytes: float, t_ours: float, t_dnn: float) -> str:
    return (f"{label:<22} {t_ours * 1e6:>10.1f} {nbytes / t_ours / 1e9:>7.1f} "
            f"{t_dnn * 1e6:>10.1f} {nbytes / t_dnn / 1e9:>7.1f} {t_dnn / t_ours:>6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--set-mb", type=int, default=96, help="weight bytes cycled per shape")
    parser.add_argument("--round-mb", type=int, default=192, help="weight bytes read per round")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_gemv.available():
        raise SystemExit("the cpu_gemv extension did not build")
    path = "AVX512-BF16" if cpu_gemv.uses_avx512_bf16() else "portable"
    print(f"cpu_gemv ({path}) vs oneDNN packed, bf16, {torch.get_num_threads()} threads; "
          f"read bandwidth (torch sum, 256 MB fp32): {read_bandwidth(5) / 1e9:.1f} GB/s")
    print(f"{'shape [N x K]':<22} {'ours us':>10} {'GB/s':>7} {'oneDNN us':>10} {'GB/s':>7} "
          f"{'ratio':>6}")
    gen = torch.Generator().manual_seed(0)
    times = {s.name: bench_shape(s, args.rows, args.rounds, args.set_mb << 20,
                                 args.round_mb << 20, gen)
             for s in SHAPES}
    for m in args.rows:
        print(f"-- M = {m}")
        for s in SHAPES:
            t_ours, t_dnn = times[s.name][m]
            print(_row(f"{s.name} [{s.n} x {s.k}]", s.weight_bytes, t_ours, t_dnn))
        step_bytes = sum(s.per_step * s.weight_bytes for s in SHAPES)
        step = [sum(s.per_step * times[s.name][m][i] for s in SHAPES) for i in range(2)]
        print(_row("whole model step", step_bytes, step[0], step[1]))


if __name__ == "__main__":
    main()
