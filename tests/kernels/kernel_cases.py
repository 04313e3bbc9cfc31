"""Shared builders for the kernel tests: paged caches, block tables, tolerances.

Cache slots that no sequence owns are NaN, so a kernel that reads past a sequence's
end (or through a padded block-table entry) without masking produces NaN and fails.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
require_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) against the fp32 reference over the same rounded inputs; bf16 and fp16
# outputs are rounded once more when stored (bf16 eps 2^-8 at magnitude ~1-2)
TOLERANCES = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2.5e-2, 2.5e-2),
}


def _cpuinfo_field(name: str) -> str:
    """The first ``name`` line's value in ``/proc/cpuinfo`` ("" if none); skips the test
    where the file cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    line = re.search(rf"^{name}\s*:(.*)$", text, re.MULTILINE)
    return line.group(1).strip() if line else ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags (``/proc/cpuinfo``)."""
    return set(_cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """The CPU's vendor id (``/proc/cpuinfo``), e.g. AuthenticAMD, GenuineIntel."""
    return _cpuinfo_field("vendor_id")


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def skip_unless_runnable() -> None:
    """Kernels run on CUDA, or on the CPU only when the interpreter flag was set in time."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if device().type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1")


def block_tables_for(
    seq_lens: list[int], block_size: int, num_blocks: int, gen: torch.Generator
) -> torch.Tensor:  # [batch, max_blocks] int32, padded with 0
    """Disjoint, shuffled (non-contiguous) blocks for each sequence."""
    need = [-(-n // block_size) for n in seq_lens]
    if sum(need) > num_blocks:
        raise ValueError("cache too small for these sequences")
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used : used + n]
        used += n
    return table


def paged_cache(
    seq_lens: list[int],
    block_tables: torch.Tensor,  # [batch, max_blocks]
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:  # k, v: [num_blocks, block_size, kv_heads, head_dim]
    """Random K/V in every owned slot, NaN in every other."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"), dtype=dtype)
    v = torch.full(shape, float("nan"), dtype=dtype)
    for i, n in enumerate(seq_lens):
        pos = torch.arange(n)
        blocks = block_tables[i, pos // block_size].long()
        offs = pos % block_size
        k[blocks, offs] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v[blocks, offs] = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
    return k, v


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOLERANCES[dtype]
    out, ref = out.float().cpu(), ref.float().cpu()
    assert not out.isnan().any(), f"{what}: NaN in the output (an unmasked read?)"
    diff = (out - ref).abs()
    bad = diff > atol + rtol * ref.abs()
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {bad.numel()} elements off, max abs diff "
        f"{float(diff.max()):.3g} (atol {atol}, rtol {rtol}, {dtype})"
    )
