"""Packed-weight GEMM for the CPU linears (bf16 and fp32): ``y = x @ W.T (+ bias)`` on a
weight packed once at load, a C++ extension built at first use, like ``cpu_gemv``.

At the row counts a decode step has (16-128 rows) a linear is neither plainly bound by
reading its weight nor by its FMAs, and oneDNN's packed linear reaches 44-71 % of the
machine's bf16 peak there. The kernel here (``csrc/cpu_gemm.cpp``) reads each weight
panel once as a prefetched sequential stream while an 8 x 48 register tile keeps the
FMA units busy (``python -m kernels.bench_linear`` compares it with oneDNN per shape and
row count). ``pack`` lays a [N, K] weight out in 48-column panels; ``linear`` takes the
packed weight and N. ``pack_gated`` / ``linear_silu`` do a SwiGLU MLP's gate_up
projection and ``silu(gate) * up`` in one call, the gate and up panels of the same
columns in turn, so the product is formed from registers and L1 instead of a [M, 2I]
tensor that the next op reads back (half of it from the other core's cache).

Numerics: each output is an fp32 sum of exact products plus the bias in fp32, rounded
once to the dtype (bf16: nearest even; vdpbf16ps flushes denormals); only the summation
order differs from ``F.linear`` on fp32 copies. ``linear_silu`` rounds the gate and up
sums as ``linear`` stores them and then applies ``cpu_fused.silu_mul``'s arithmetic (the
shared ``csrc/cpu_silu.h``): bit-equal to ``silu_mul(linear(x, pack(W), 2 I, b))``.
The op checks its inputs (ValueError). ``available()`` reports whether it built;
``simd_dtypes()`` which dtypes run vector kernels: AVX-512 tiles for fp32, and for bf16
with AVX512-BF16 (``vdpbf16ps``) or, without it (Ice Lake class), AVX-512 tiles that
widen each bf16 pair of the panel to fp32 in registers (exact products, fp32 sums, as
the AVX2 ones); else 256-bit AVX2 + FMA tiles (bf16 widened to fp32 in registers, or a
panel at a time from 32 rows); ``tile_paths()`` which (``avx512``, ``avx512_widen``,
``avx2``, ``portable``). Without AVX2 the op runs portable loops (tests only), and
callers keep oneDNN.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import CSRC, SCALAR_HEADER, LazyExtension, build_extension

_SOURCE = CSRC / "cpu_gemm.cpp"
OP_NAMESPACE = "pagoda_cpu_gemm"  # the source's default PAGODA_OP_NS


def build_library(namespace: str = OP_NAMESPACE, defines: tuple[str, ...] = (),
                  cflags: tuple[str, ...] = ()) -> None:
    """Compile (or load from the cache) the kernel as ``torch.ops.<namespace>``; tests
    build the portable path as a variant (``defines=("PAGODA_PORTABLE",)``), and the
    widening bf16 tiles on an AVX512-BF16 CPU (``cflags=("-mno-avx512bf16",)``)."""
    # no FMA contraction: the gated epilogue's SiLU must round as cpu_fused's (the GEMM's
    # own FMAs are intrinsics)
    build_extension(namespace, _SOURCE, [SCALAR_HEADER, CSRC / "cpu_silu.h"],
                    extra_cflags=("-ffp-contract=off", *cflags), defines=defines)


_extension = LazyExtension("cpu_gemm kernel", lambda: build_library())


def available() -> bool:
    """Build (once per process) and report whether the kernel can run; never raises."""
    return _extension.available()


def _ops():  # type: ignore[no-untyped-def]
    if not available():
        raise RuntimeError("the cpu_gemm extension did not build; see the logged warning")
    return torch.ops.pagoda_cpu_gemm


def simd_dtypes() -> frozenset[torch.dtype]:
    """The dtypes this build runs with vector kernels (empty where it did not build)."""
    if not available():
        return frozenset()
    names = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    return frozenset(names[n] for n in _ops().simd_dtypes())


def tile_paths() -> dict[torch.dtype, str]:
    """Which tiles each dtype runs in this build: ``avx512``, ``avx2`` or ``portable``
    (empty where it did not build)."""
    if not available():
        return {}
    f32, bf16 = _ops().tile_paths()
    return {torch.float32: f32, torch.bfloat16: bf16}


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The [N, K] bf16 / fp32 weight in the kernel's panel layout (a new tensor)."""
    return _ops().pack(weight.detach())  # type: ignore[no-any-return]


def pack_gated(weight: torch.Tensor) -> torch.Tensor:
    """A [2 I, K] gate_up weight (gate rows, then up rows) packed for ``linear_silu``."""
    return _ops().pack_gated(weight.detach())  # type: ignore[no-any-return]


def linear_silu(x: torch.Tensor, packed: torch.Tensor, n: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """``silu(x @ W_gate.T + b_gate) * (x @ W_up.T + b_up)`` [M, n] for ``packed =
    pack_gated(W)``, n = I; bias [2 I] (gate's, then up's) or None."""
    return _ops().linear_silu(x, packed, n, bias)  # type: ignore[no-any-return]


def linear(x: torch.Tensor, packed: torch.Tensor, n: int,
           bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` for ``packed = pack(W)`` with ``n = W.shape[0]``; x [M, K] of the
    weight's dtype (rows any distance apart), bias [n] or None. The op checks that the
    packed weight has the panels and steps of an [n, K] weight; a weight that pads to the
    same ones (N within the same 48, or bf16 K one less) is the caller's to rule out,
    which ``layers.linear.PackedWeight`` does by keeping n with its packed weight."""
    return _ops().linear(x, packed, n, bias)  # type: ignore[no-any-return]
