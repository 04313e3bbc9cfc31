"""The Triton cache write against reference.write_kv_cache (an exact copy)."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import DTYPES, device, require_triton, skip_unless_runnable
from kernels import reference

pytestmark = require_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 2, 64), (32, 1, 128)])
def test_write_matches_reference_and_skips_padding(
    dtype: torch.dtype, block_size: int, num_kv_heads: int, head_dim: int
) -> None:
    skip_unless_runnable()
    from kernels.cache_write import write_kv_cache

    dev, gen = device(), torch.Generator().manual_seed(0)
    num_tokens, num_blocks = 9, 4
    # key/value as views of a fused qkv row (token stride > heads * head_dim), like the model
    row = (2 + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, row, generator=gen).to(dtype)
    kv_shape = (num_tokens, num_kv_heads, head_dim)
    key = qkv[:, 2 * head_dim : (2 + num_kv_heads) * head_dim].view(kv_shape)
    value = qkv[:, (2 + num_kv_heads) * head_dim :].view(kv_shape)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[1, 5]] = -1  # padded tokens: never written
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_ref = torch.randn(shape, generator=gen).to(dtype)
    v_ref = torch.randn(shape, generator=gen).to(dtype)
    k_out, v_out = k_ref.clone().to(dev), v_ref.clone().to(dev)

    write_kv_cache(key.to(dev), value.to(dev), k_out, v_out, slots.to(dev))
    reference.write_kv_cache(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_out.cpu(), k_ref), "k_cache differs from the reference write"
    assert torch.equal(v_out.cpu(), v_ref), "v_cache differs from the reference write"


def test_write_converts_to_cache_dtype() -> None:
    skip_unless_runnable()
    from kernels.cache_write import write_kv_cache

    dev, gen = device(), torch.Generator().manual_seed(1)
    # fp32 K/V into an fp16 cache (not bf16: the interpreter truncates to bf16 where the
    # GPU and torch round to nearest even, a 1-ulp difference that is no kernel bug)
    key, value = torch.randn(2, 3, 2, 64, generator=gen)
    k_out = torch.zeros(2, 16, 2, 64, dtype=torch.float16)
    v_out, k_ref, v_ref = k_out.clone(), k_out.clone(), k_out.clone()
    slots = torch.tensor([0, 17, 31])
    k_dev, v_dev = k_out.to(dev), v_out.to(dev)
    write_kv_cache(key.to(dev), value.to(dev), k_dev, v_dev, slots.to(dev))
    reference.write_kv_cache(key, value, k_ref, v_ref, slots)
    assert torch.equal(k_dev.cpu(), k_ref) and torch.equal(v_dev.cpu(), v_ref)
