"""Shared by the fused small-op kernel tests (test_fused_*.py): the rounding-level
comparison with the torch path, and the layers' Triton path forced onto CPU tensors.

The kernels round where torch rounds, so a bf16 / fp16 output differs from torch's
only where an fp32 intermediate (a sum of squares in another order, an exp one ulp
off) sits at a rounding tie of the dtype: ``compare`` bounds how far (in units of the
dtype's eps, relative) and how often, and returns the exact-match fraction. With CUDA
the tests run the compiled kernels on CUDA tensors, so the references are torch's CUDA
ops; without, the interpreter on CPU tensors against torch's CPU ops.
"""

from __future__ import annotations

import pytest
import torch

EPS = {dtype: torch.finfo(dtype).eps for dtype in (torch.float32, torch.float16, torch.bfloat16)}


def compare(got: torch.Tensor, ref: torch.Tensor, what: str, *, eps_units: float = 0.0,
            max_off: float = 0.0, atol: float = 0.0) -> float:
    """Asserts |got - ref| <= atol + eps_units * eps(dtype) * |ref| everywhere and that at
    most a ``max_off`` fraction of elements differ at all; NaN must meet NaN. Returns the
    fraction of elements that are bit-identical (NaN counting as equal)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, \
        f"{what}: {got.dtype} {tuple(got.shape)} vs {ref.dtype} {tuple(ref.shape)}"
    g, r = got.float().cpu(), ref.float().cpu()
    assert torch.equal(g.isnan(), r.isnan()), f"{what}: NaN where the reference has none"
    same = (g == r) | (g.isnan() & r.isnan())
    diff = (g - r).abs().nan_to_num(0.0)
    bad = diff > atol + eps_units * EPS[ref.dtype] * r.abs()
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} elements beyond "
                           f"{eps_units} eps, max diff {float(diff.max()):.3g}")
    exact = float(same.float().mean()) if same.numel() else 1.0
    assert 1.0 - exact <= max_off, f"{what}: only {exact:.4f} of the elements exact"
    return exact


def force_triton_path(monkeypatch: pytest.MonkeyPatch, module: object) -> list[tuple]:
    """Makes a layer module's ``use_triton`` say yes for any device (CPU tensors run
    the kernels in the interpreter); returns the list of (device, dtype) it was asked."""
    calls: list[tuple] = []

    def use_triton(fused: bool, device: torch.device, dtype: torch.dtype) -> bool:
        calls.append((device, dtype))
        return fused

    monkeypatch.setattr(module, "use_triton", use_triton)
    return calls


def spy(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Counts the calls of ``module.name`` (still called through); returns the counter."""
    calls: list[int] = []
    fn = getattr(module, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return fn(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls
