"""The import guard: kernel modules import without Triton and fail clearly when launched;
launchers refuse CPU tensors unless the interpreter is on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernel_cases import require_triton, skip_unless_runnable

ROOT = Path(__file__).resolve().parents[2]

_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # any `import triton` now raises ImportError
import torch
from kernels import (bench, cache_write, fused_activation, fused_norm, fused_rotary,
                     paged_decode, prefill)
from kernels.triton_utils import HAS_TRITON
assert not HAS_TRITON
assert paged_decode.choose_num_splits(1, 8, 32768, 132) == 32  # pure Python still works
x = torch.zeros(1, 1, 16)
try:
    cache_write.write_kv_cache(x, x, torch.zeros(1, 16, 1, 16), torch.zeros(1, 16, 1, 16),
                               torch.zeros(1, dtype=torch.long))
except RuntimeError as e:
    assert "Triton is not installed" in str(e), e
else:
    raise AssertionError("launch without triton did not raise")
try:
    fused_activation.act_mul(torch.zeros(1, 4))
except RuntimeError as e:
    assert "Triton is not installed" in str(e), e
else:
    raise AssertionError("fused launch without triton did not raise")
from services.worker.layers.norm import RMSNorm
out, _ = RMSNorm(16, 1e-6)(torch.ones(2, 16))  # the layers still run (C++ or torch ops)
assert torch.allclose(out, torch.ones(2, 16))
from services.worker.attention.triton_backend import TritonAttentionBackend
try:
    TritonAttentionBackend()
except RuntimeError as e:
    assert "triton" in str(e), e
else:
    raise AssertionError("backend without triton did not raise")
print("ok")
"""


def test_kernel_modules_import_without_triton() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRITON], cwd=ROOT, capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


@require_triton
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cpu_tensors_rejected_outside_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    skip_unless_runnable()
    from kernels.cache_write import write_kv_cache

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.zeros(1, 1, 16)
    cache = torch.zeros(1, 16, 1, 16)
    with pytest.raises(RuntimeError, match="need CUDA tensors"):
        write_kv_cache(x, x, cache, cache.clone(), torch.zeros(1, dtype=torch.long))
