"""Cache write: each new token's K/V into its flat slot of the paged cache.

One program per token copies all of its KV heads (``num_kv_heads * head_dim``
contiguous elements) for K and V; a slot of -1 (padding) is skipped. The launcher
checks strides so the kernel can assume a dense token row. Adapted idea: nano-vllm
``layers/attention.py`` (store_kvcache). Reference: ``reference.write_kv_cache``.
"""

import torch

from kernels.triton_utils import check_launchable, next_pow2, tl, triton


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim], rows key_stride apart
    value_ptr,  # [num_tokens, num_kv_heads, head_dim], rows value_stride apart
    k_cache_ptr,  # [num_blocks * block_size, num_kv_heads * head_dim] contiguous
    v_cache_ptr,  # [num_blocks * block_size, num_kv_heads * head_dim] contiguous
    slot_mapping_ptr,  # [num_tokens] int64, -1 = padded token
    key_stride,
    value_stride,
    ROW: tl.constexpr,  # num_kv_heads * head_dim
    ROW_PAD: tl.constexpr,  # ROW rounded up to a power of two (tl.arange needs one)
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, ROW_PAD)  # [ROW_PAD]
    mask = offs < ROW
    k = tl.load(key_ptr + token.to(tl.int64) * key_stride + offs, mask=mask)  # [ROW_PAD]
    v = tl.load(value_ptr + token.to(tl.int64) * value_stride + offs, mask=mask)
    # int64 slot arithmetic: slot * ROW overflows int32 for caches past 2^31 elements
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int, -1 = skip
) -> None:
    """Triton version of ``reference.write_kv_cache`` (same arguments, same effect)."""
    check_launchable(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    row = num_kv_heads * head_dim
    # a token's heads must be one dense row (true for views of the fused qkv output)
    for name, t in (("key", key), ("value", value)):
        if t.shape != key.shape or t.stride(2) != 1 or t.stride(1) != head_dim:
            raise ValueError(f"{name} must be dense within a token, got stride {t.stride()}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not c.is_contiguous() or c.shape[2:] != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must be contiguous [blocks, block_size, {num_kv_heads}, "
                             f"{head_dim}], got {tuple(c.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
        ROW=row, ROW_PAD=next_pow2(row),
    )
