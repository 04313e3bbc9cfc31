"""`python -m kernels.bench` runs its interpreter smoke check (no GPU) end to end."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import require_triton, skip_unless_runnable


@require_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the bench is the full sweep")
def test_bench_smoke_check_prints_every_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    skip_unless_runnable()
    from kernels import bench

    bench.main([])
    lines = capsys.readouterr().out.splitlines()
    kernels = [line.split()[0] for line in lines if not line.startswith(("#", "kernel"))]
    assert kernels == ["decode", "decode", "prefill", "prefill", "cache_write"], lines
