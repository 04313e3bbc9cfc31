"""Which implementation a layer's small fused ops take (layers/fused_path.py): Triton
for CUDA tensors when Triton is installed, never for CPU tensors (they keep the C++
kernels), nor for a module built with fused=False, nor for a dtype the kernels lack.
The layers' Triton paths themselves run in tests/kernels/test_fused_*.py."""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch

from services.worker.layers.fused_path import TRITON_DTYPES, use_triton

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize("dtype", TRITON_DTYPES)
def test_cuda_tensors_take_triton(dtype: torch.dtype) -> None:
    assert use_triton(True, CUDA, dtype, has_triton=True)
    assert use_triton(True, torch.device("cuda", 1), dtype, has_triton=True)


def test_everything_else_does_not() -> None:
    assert not use_triton(True, CPU, torch.bfloat16, has_triton=True), "CPU keeps the C++ path"
    assert not use_triton(False, CUDA, torch.bfloat16, has_triton=True), "fused=False: torch ops"
    assert not use_triton(True, CUDA, torch.bfloat16, has_triton=False), "no Triton: torch ops"
    assert not use_triton(True, CUDA, torch.float64, has_triton=True)
    assert not use_triton(True, torch.device("meta"), torch.float32, has_triton=True)


def test_cpu_layers_keep_the_cpp_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CPU tensors the layers never import a Triton kernel module (an import would
    raise here) and call the C++ kernels where they build, as before."""
    import kernels
    from kernels import cpu_fused
    from services.worker.layers.norm import RMSNorm
    from services.worker.layers.rotary import RotaryEmbedding

    for name in ("fused_norm", "fused_rotary"):
        monkeypatch.setitem(sys.modules, f"kernels.{name}", None)  # import -> ImportError
        monkeypatch.delattr(kernels, name, raising=False)
    calls: list[str] = []

    def counting(name: str) -> Any:
        fn = getattr(cpu_fused, name)

        def counted(*args: object) -> Any:
            calls.append(name)
            return fn(*args)

        return counted

    for name in ("rms_norm", "rotary"):
        monkeypatch.setattr(cpu_fused, name, counting(name))
    RMSNorm(64, 1e-6)(torch.randn(3, 64), torch.randn(3, 64))
    RotaryEmbedding(64, 16, 10000.0, None)(torch.arange(3), torch.randn(3, 2, 64),
                                           torch.randn(3, 1, 64))
    assert calls == (["rms_norm", "rotary"] if cpu_fused.available() else [])
