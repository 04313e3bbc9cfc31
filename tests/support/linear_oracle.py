"""The oracle of the CPU linear kernels' tests (``kernels.cpu_gemm``, ``kernels.cpu_gemv``):
their output against ``F.linear`` on fp32 copies, with the bounds the test modules
argue for (bf16: within 1e-2 relative, and bit-equal on >= 99 % of outputs; fp32:
within (K + 1) eps of the sum of |products| and bias)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """bf16 ulps between a and b (finite values; +0 and -0 are the same)."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -(i & 0x7FFF), i)
    return (ordered(a) - ordered(b)).abs()


def assert_linear_matches(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                          bias: torch.Tensor | None, what: str) -> None:
    """``got`` is ``x @ w.T + bias`` of x's dtype and shape, contiguous, within the bounds."""
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert got.dtype == x.dtype and got.shape == ref.shape, f"{what}: {got.dtype} {got.shape}"
    assert got.is_contiguous(), f"{what}: strides {got.stride()}"
    magnitude = F.linear(x.float().abs(), w.float().abs())  # sum of |products|
    if bias is not None:
        magnitude = magnitude + bias.float().abs()
    if x.dtype == torch.float32:
        tol = (x.shape[1] + 1) * torch.finfo(torch.float32).eps * magnitude
        diff = (got - ref).abs()
        too_far = diff > tol
        assert not too_far.any(), (
            f"{what}: {int(too_far.sum())} outputs off, max {float(diff.max()):.3g} "
            f"(bound there {float(tol.flatten()[int(diff.argmax())]):.3g})")
        return
    diff = (got.float() - ref.bfloat16().float()).abs()
    too_far = diff > 1e-2 * ref.abs() + 1e-5 * magnitude
    assert not too_far.any(), (
        f"{what}: {int(too_far.sum())} outputs off, max {float(diff.max()):.3g}")
    unequal = int((bf16_ulps(got, ref.bfloat16()) != 0).sum())
    assert unequal <= max(1, got.numel() // 100), f"{what}: {unequal} of {got.numel()} differ"
