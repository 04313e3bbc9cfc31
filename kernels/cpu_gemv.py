"""Small-batch bf16 linear for the CPU decode step: ``y = x @ W.T (+ bias)`` for a few
rows of x, a C++ extension built at first use, like ``cpu_decode``.

At batch 1 a linear reads each weight once for two flops, so a decode step's linears are
bound by memory bandwidth. oneDNN's bf16 linear on packed weights reads them well below
what the machine delivers (its fp32 path does not); the kernel here
(``csrc/cpu_gemv.cpp``) streams the plain row-major weight ([N, K], as the model stores
it, no packing) at close to full bandwidth with AVX512-BF16 ``vdpbf16ps``, and falls back
to portable fp32 loops elsewhere. Tuned for 1..8 rows; more rows loop over groups of 8
(``python -m kernels.bench_linear`` compares it with oneDNN per shape and row count).

Numerics: each output is an fp32 sum of exact bf16 products plus the bias in fp32,
rounded once to bf16 (nearest even); only the summation order differs from
``F.linear(x.float(), W.float(), b.float()).bfloat16()`` (an ulp where the sum sits near
a tie; vdpbf16ps also flushes denormals). The op checks its inputs (ValueError): bf16
CPU tensors, x [M, K] (rows any distance apart; another layout is copied), W [N, K]
contiguous, bias [N] or None. ``available()`` reports whether it built; callers keep the
torch path.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import CSRC, SCALAR_HEADER, LazyExtension, build_extension

_SOURCE = CSRC / "cpu_gemv.cpp"
OP_NAMESPACE = "pagoda_cpu_gemv"  # the source's default PAGODA_OP_NS


def build_library(namespace: str = OP_NAMESPACE, defines: tuple[str, ...] = ()) -> None:
    """Compile (or load from the cache) the kernel as ``torch.ops.<namespace>``; tests
    build the portable path as a variant (``defines=("PAGODA_PORTABLE",)``)."""
    build_extension(namespace, _SOURCE, [CSRC / "cpu_reduce16.h", SCALAR_HEADER], defines=defines)


# a lambda: the source path is read at build time
_extension = LazyExtension("cpu_gemv kernel", lambda: build_library())


def available() -> bool:
    """Build (once per process) and report whether the kernel can run; never raises."""
    return _extension.available()


def uses_avx512_bf16() -> bool:
    """Whether the build runs the AVX512-BF16 path (else the portable loops)."""
    return bool(_ops().uses_avx512_bf16())


def _ops():  # type: ignore[no-untyped-def]
    if not available():
        raise RuntimeError("the cpu_gemv extension did not build; see the logged warning")
    return torch.ops.pagoda_cpu_gemv


def linear_bf16(
    x: torch.Tensor,  # [M, K] bf16
    weight: torch.Tensor,  # [N, K] bf16, contiguous
    bias: torch.Tensor | None,  # [N] bf16 or None
) -> torch.Tensor:  # [M, N] bf16
    """``x @ weight.T + bias`` in bf16 with fp32 accumulation; raises RuntimeError when the
    extension did not build (check ``available()`` first)."""
    return _ops().linear_bf16(x, weight, bias)  # type: ignore[no-any-return]
