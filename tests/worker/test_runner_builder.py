"""``runner_builder.resolve_dtype``: what ``--dtype auto`` computes in, by device and CPU;
``resolve_kv_cache_dtype``: the KV cache's element type.

The CPU's features and the linear kernel the engine would pick are faked, so every
machine kind's choice is checked on whichever machine runs the tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.worker import runner_builder
from services.worker.runner_builder import resolve_dtype, resolve_kv_cache_dtype

CPU = torch.device("cpu")


def _fake_cpu(monkeypatch: pytest.MonkeyPatch, features: set[str], bf16_kernel: str) -> None:
    real: dict[str, Any] = torch.cpu.get_capabilities()
    fake = {**{k: False for k in ("avx512_bf16", "amx_bf16", "avx512f")},
            **{k: True for k in features}}
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {**real, **fake})
    monkeypatch.setattr(runner_builder, "auto_kernel",
                        lambda dtype: bf16_kernel if dtype == torch.bfloat16 else "cpu_gemm")


@pytest.mark.parametrize(("features", "bf16_kernel", "want"), [
    ({"avx512f", "avx512_bf16"}, "cpu_gemm", torch.bfloat16),  # Zen 4/5, Cooper Lake
    ({"avx512f", "avx512_bf16", "amx_bf16"}, "onednn", torch.bfloat16),  # Sapphire Rapids
    (set(), "cpu_gemm", torch.bfloat16),  # AVX2 only: cpu_gemm's 256-bit bf16 tiles
    ({"avx512f"}, "cpu_gemm", torch.bfloat16),  # AVX-512 without BF16: widening tiles
    (set(), "onednn", torch.float32),  # no compiled GEMM (or no AVX2): oneDNN / F.linear
])
def test_auto_is_bf16_where_it_is_the_faster_cpu_dtype(
        monkeypatch: pytest.MonkeyPatch, features: set[str], bf16_kernel: str,
        want: torch.dtype) -> None:
    _fake_cpu(monkeypatch, features, bf16_kernel)
    assert resolve_dtype("auto", CPU) == want


def test_an_explicit_dtype_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_cpu(monkeypatch, {"avx512f", "avx512_bf16"}, "cpu_gemm")
    assert resolve_dtype("float32", CPU) == torch.float32
    _fake_cpu(monkeypatch, set(), "onednn")
    assert resolve_dtype("bfloat16", CPU) == torch.bfloat16


@pytest.mark.parametrize(("setting", "dtype", "device", "want"), [
    ("auto", torch.float32, "cpu", torch.float32),
    ("auto", torch.bfloat16, "cuda", torch.bfloat16),
    ("bfloat16", torch.float32, "cpu", torch.bfloat16),  # the opt-in: half the KV bytes
    ("bfloat16", torch.bfloat16, "cpu", torch.bfloat16),
    ("bfloat16", torch.bfloat16, "cuda", torch.bfloat16),  # the model's own: nothing changes
])
def test_kv_cache_dtype(setting: str, dtype: torch.dtype, device: str, want: torch.dtype) -> None:
    assert resolve_kv_cache_dtype(setting, dtype, torch.device(device)) == want


@pytest.mark.parametrize(("dtype", "device", "match"), [
    (torch.float32, "cuda", "CPU only"), (torch.float16, "cuda", "not float16"),
    (torch.float16, "cpu", "not float16")])
def test_a_bf16_kv_cache_the_kernels_cannot_read_is_refused(dtype: torch.dtype, device: str,
                                                            match: str) -> None:
    with pytest.raises(ValueError, match=f"--kv-cache-dtype bfloat16.*{match}"):
        resolve_kv_cache_dtype("bfloat16", dtype, torch.device(device))
