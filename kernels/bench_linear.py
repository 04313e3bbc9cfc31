"""Benchmark (not a test): the CPU linears, ``cpu_gemm`` beside oneDNN (and ``cpu_gemv``).

    python -m kernels.bench_linear [--dtype bfloat16|float32] [--rows 1 2 4 8 16 32 64 128 256]
        [--rounds 25] [--set-mb 96] [--round-mb 192] [--threads N]

For each linear of SmolLM2-135M (hidden 576) at each row count M: the median time of one
call of ``cpu_gemm.linear`` on its packed weight, of oneDNN's linear on its packed weight
(``_reorder_linear_weight`` then ``_linear_pointwise``, the path
``services/worker/layers/linear.py`` keeps where cpu_gemm has no vector kernel; where
oneDNN cannot pack the dtype, bf16 on a CPU without AVX-512, torch's ``F.linear``, the
engine's fallback there, stands in its column) and, in
bf16 at M <= 8 (the rows it is tuned for), of ``cpu_gemv.linear_bf16`` on the plain
weight; for each its GFLOP/s (2 M N K flops a call) and weight-read bandwidth (N K
elements a call), and the ratios oneDNN time / cpu_gemm time and cpu_gemv / cpu_gemm
(above 1, cpu_gemm is faster). The kernels' outputs are checked to agree first.

Each measurement cycles through enough copies of the weights (``--set-mb``, beyond the
32 MB L3) that every call reads its weights from DRAM, as in a real step, whose 270 MB
(bf16) of weights go through the cache once. Rounds of the kernels alternate, so all
see the same machine; on a shared host its memory bandwidth can change by 2x from one
minute to the next, so compare the ratios of one run. A round is ``--round-mb`` of
weight reads, or fewer calls where they are compute-bound: no more flops than the peak
does in the time those bytes take at the read bandwidth (so a round lasts about as long
at M = 256 as at M = 1).

The header gives the thread count (torch's; ``--threads`` to set it), the machine's
read bandwidth (torch sum of a 256 MB fp32 tensor) and its matmul peak in the dtype: the
best of a few 1024 x 1024 x 1024 products through oneDNN's packed linear and cpu_gemm
(where both fall well short of the FMA units' nominal rate, this is what a linear here
can reach). The "whole model step" line per M adds up 30 layers x (qkv, o, gate_up,
down) and the lm_head once, and gives each kernel's GFLOP/s there as a % of that peak.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import cpu_gemm, cpu_gemv

LAYERS = 30
GEMV_MAX_ROWS = 8  # cpu_gemv's register tile; beyond it it loops over tiles (not its case)
PEAK_SIZE = 1024


@dataclass(frozen=True)
class Shape:
    name: str
    n: int  # output features
    k: int  # input features
    per_step: int  # calls per model step

    def flops(self, m: int) -> int:
        return 2 * m * self.n * self.k

    def weight_bytes(self, dtype: torch.dtype) -> int:
        return self.n * self.k * dtype.itemsize


SHAPES = (
    Shape("qkv", 960, 576, LAYERS),
    Shape("o", 576, 576, LAYERS),
    Shape("gate_up", 3072, 576, LAYERS),
    Shape("down", 576, 1536, LAYERS),
    Shape("lm_head", 49152, 576, 1),
)
KERNELS = ("cpu_gemm", "oneDNN", "cpu_gemv")  # the order of the times in a result


def read_bandwidth(rounds: int) -> float:  # bytes / s of torch's sum over a 256 MB tensor
    t = torch.ones(64 * 1024 * 1024)
    t.sum()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        t.sum()
        times.append(time.perf_counter() - start)
    return t.numel() * 4 / statistics.median(times)


@functools.cache  # asked on every timed baseline call: probe once
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs a linear weight of this dtype here (bf16 needs AVX-512 or
    AVX-NE-CONVERT; elsewhere torch's F.linear is the baseline, as the engine falls back)."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 8)
    except RuntimeError:
        return False
    return True


def _baseline_pack(w: torch.Tensor, batch_hint: int = 64) -> torch.Tensor:
    if not onednn_packs(w.dtype):
        return w
    return torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)  # type: ignore[no-any-return]


def _baseline(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    if not onednn_packs(x.dtype):
        return F.linear(x, packed)
    return torch.ops.mkldnn._linear_pointwise(  # type: ignore[no-any-return]
        x, packed, None, "none", [], "")


def matmul_peak(dtype: torch.dtype, tries: int = 5) -> float:
    """FLOP/s: the best of `tries` 1024^3 products through oneDNN's packed linear and
    cpu_gemm, after a warm-up call of each (the most a linear of this machine reaches)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(PEAK_SIZE, PEAK_SIZE, generator=gen).to(dtype)
    x = torch.randn(PEAK_SIZE, PEAK_SIZE, generator=gen).to(dtype)
    dnn_w, gemm_w = _baseline_pack(w, PEAK_SIZE), cpu_gemm.pack(w)
    best = math.inf
    for fn in (lambda: _baseline(x, dnn_w), lambda: cpu_gemm.linear(x, gemm_w, PEAK_SIZE, None)):
        fn()
        for _ in range(tries):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
    return 2 * PEAK_SIZE**3 / best


def time_rounds(
    fns: Sequence[Callable[[int], object]], copies: int, calls: int, rounds: int
) -> list[float]:  # median seconds per call of each fn (called with a copy index)
    """Rounds of `calls` calls of each fn in turn; each fn cycles through the copies
    across rounds (a round of long calls may be fewer calls than there are copies, and
    its first call must still find its copy evicted). The order of the fns rotates from
    one round to the next (no fn always follows the same one)."""
    per_call: list[list[float]] = [[] for _ in fns]
    for fn in fns:  # warm-up: first touch, the pool's threads, oneDNN's primitive cache
        for c in range(copies):
            fn(c)
    next_copy = [0] * len(fns)
    for r in range(rounds):
        for i in [*range(r % len(fns), len(fns)), *range(r % len(fns))]:
            fn, c = fns[i], next_copy[i]
            start = time.perf_counter()
            for _ in range(calls):
                fn(c)
                c = c + 1 if c + 1 < copies else 0
            per_call[i].append((time.perf_counter() - start) / calls)
            next_copy[i] = c
    return [statistics.median(t) for t in per_call]


Times = tuple[float, float, float | None]  # seconds per call: cpu_gemm, oneDNN, cpu_gemv


def bench_shape(shape: Shape, dtype: torch.dtype, rows: list[int], rounds: int,
                set_bytes: int, round_bytes: int, round_flops: float, use_gemv: bool,
                gen: torch.Generator) -> dict[int, Times]:
    """{M: median seconds per call of each kernel}."""
    wbytes = shape.weight_bytes(dtype)
    copies = max(2, math.ceil(set_bytes / wbytes))
    weights = [(torch.randn(shape.n, shape.k, generator=gen) * 0.05).to(dtype)
               for _ in range(copies)]
    gemm_w = [cpu_gemm.pack(w) for w in weights]
    dnn_w = [_baseline_pack(w) for w in weights]
    gemv_rows = GEMV_MAX_ROWS if use_gemv else 0
    if not use_gemv or min(rows) > gemv_rows:
        weights = []  # cpu_gemv takes the plain weights; nothing else does
    rtol, atol = (2e-2, 2e-2) if dtype == torch.bfloat16 else (1e-4, 1e-4)
    result: dict[int, Times] = {}
    for m in rows:
        x = torch.randn(m, shape.k, generator=gen).to(dtype)

        def run_gemm(c: int, x: torch.Tensor = x) -> torch.Tensor:
            return cpu_gemm.linear(x, gemm_w[c], shape.n, None)

        def run_onednn(c: int, x: torch.Tensor = x) -> torch.Tensor:
            return _baseline(x, dnn_w[c])

        def run_gemv(c: int, x: torch.Tensor = x) -> torch.Tensor:
            return cpu_gemv.linear_bf16(x, weights[c], None)

        fns = [run_gemm, run_onednn, *([run_gemv] if m <= gemv_rows else [])]
        ref = run_gemm(0)
        for name, fn in zip(KERNELS[1:], fns[1:], strict=False):
            if not torch.allclose(ref.float(), fn(0).float(), rtol=rtol, atol=atol):
                raise AssertionError(f"{shape.name} M={m}: cpu_gemm and {name} disagree")
        # a round: round_bytes of weight reads, or the flops the peak does meanwhile
        calls = max(1, math.ceil(min(round_bytes / wbytes, round_flops / shape.flops(m))))
        t = time_rounds(fns, copies, calls, rounds)
        result[m] = (t[0], t[1], t[2] if len(t) > 2 else None)
    return result


def _cols(t: float | None, flops: float, nbytes: float) -> str:
    if t is None:
        return f"{'-':>11} {'-':>8} {'-':>6}"
    return f"{t * 1e6:>11.1f} {flops / t / 1e9:>8.1f} {nbytes / t / 1e9:>6.1f}"


def _ratio(num: float | None, den: float) -> str:
    return f"{'-':>9}" if num is None else f"{num / den:>9.2f}"


def _row(label: str, flops: float, nbytes: float, t: Times) -> str:
    return (f"{label:<22} {' | '.join(_cols(ti, flops, nbytes) for ti in t)} |"
            f"{_ratio(t[1], t[0])}{_ratio(t[2], t[0])}")


def _step_time(times: dict[str, dict[int, Times]], m: int, kernel: int) -> float | None:
    """Seconds of one model step at M rows through one kernel (None: it skips a shape)."""
    total = 0.0
    for s in SHAPES:
        t = times[s.name][m][kernel]
        if t is None:
            return None
        total += s.per_step * t
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--rows", type=int, nargs="+",
                        default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--set-mb", type=int, default=96, help="weight bytes cycled per shape")
    parser.add_argument("--round-mb", type=int, default=192, help="weight bytes read per round")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    dtype: torch.dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_gemm.available():
        raise SystemExit("the cpu_gemm extension did not build")
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch has no oneDNN (mkldnn)")
    use_gemv = dtype == torch.bfloat16 and cpu_gemv.available()
    path = cpu_gemm.tile_paths()[dtype]
    baseline = "oneDNN packed" if onednn_packs(dtype) else "F.linear (oneDNN cannot pack it)"
    bandwidth, peak = read_bandwidth(5), matmul_peak(dtype)
    print(f"cpu_gemm ({path} tiles) vs {baseline}{' and cpu_gemv' if use_gemv else ''}, "
          f"{args.dtype}, {torch.get_num_threads()} threads; read bandwidth (torch sum, "
          f"256 MB fp32): {bandwidth / 1e9:.1f} GB/s; matmul peak (best {PEAK_SIZE}^3 "
          f"of oneDNN, cpu_gemm): {peak / 1e9:.0f} GFLOP/s")
    kernel_head = " | ".join(f"{k + ' us':>11} {'GFLOP/s':>8} {'GB/s':>6}" for k in KERNELS)
    print(f"{'shape [N x K]':<22} {kernel_head} |{'dnn/gemm':>9}{'gemv/gemm':>10}")
    gen = torch.Generator().manual_seed(0)
    round_bytes = args.round_mb << 20
    round_flops = peak * round_bytes / bandwidth
    times = {s.name: bench_shape(s, dtype, args.rows, args.rounds, args.set_mb << 20,
                                 round_bytes, round_flops, use_gemv, gen)
             for s in SHAPES}
    for m in args.rows:
        print(f"-- M = {m}")
        for s in SHAPES:
            print(_row(f"{s.name} [{s.n} x {s.k}]", s.flops(m), s.weight_bytes(dtype),
                       times[s.name][m]))
        step_flops = sum(s.per_step * s.flops(m) for s in SHAPES)
        step_bytes = sum(s.per_step * s.weight_bytes(dtype) for s in SHAPES)
        step = [_step_time(times, m, i) for i in range(len(KERNELS))]
        gemm_t, dnn_t = step[0], step[1]
        assert gemm_t is not None and dnn_t is not None  # both run at every M
        print(f"{_row('whole model step', step_flops, step_bytes, (gemm_t, dnn_t, step[2]))}"
              f"   % of peak: cpu_gemm {100 * step_flops / gemm_t / peak:.1f}, "
              f"oneDNN {100 * step_flops / dnn_t / peak:.1f}")


if __name__ == "__main__":
    main()
