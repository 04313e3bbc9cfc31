"""Input checks the CPU attention kernels (``cpu_decode``, ``cpu_prefill``) share.

Their C++ reads the query, the paged caches ([num_blocks, block_size, num_kv_heads,
head_dim]), the index tensors and ``out`` as raw contiguous buffers of a few dtypes;
anything else must be refused before the call, as a ValueError.
"""

from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256


def check_heads(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """A [tokens, num_heads, head_dim] query against two like caches: head_dim a multiple
    of 8 up to MAX_HEAD_DIM on both sides, num_heads a multiple of num_kv_heads."""
    if query.ndim != 3 or k_cache.ndim != 4:
        raise ValueError(f"query must be 3-D, k_cache 4-D; got {query.ndim}-D, {k_cache.ndim}-D")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} != v_cache {tuple(v_cache.shape)}")
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, cache_head_dim = k_cache.shape[2:]
    if cache_head_dim != head_dim or head_dim % 8 or not 0 < head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"head_dim {head_dim} (cache: {cache_head_dim}) must match and be a multiple "
            f"of 8 up to {MAX_HEAD_DIM}"
        )
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")


def check_buffers(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    indices: dict[str, torch.Tensor], out: torch.Tensor | None,
) -> None:
    """One dtype in DTYPES for query and caches (or an fp32 query over bf16 caches, an
    fp32 model's bf16 KV cache), INDEX_DTYPES for each named index tensor, ``out`` like
    query, and every tensor contiguous on the CPU."""
    if (query.dtype not in DTYPES or k_cache.dtype != v_cache.dtype
            or k_cache.dtype not in (query.dtype, torch.bfloat16)):
        raise ValueError(
            f"query, k_cache, v_cache must share a dtype in {DTYPES} (or be float32 over "
            f"bfloat16 caches); got {query.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if any(t.dtype not in INDEX_DTYPES for t in indices.values()):
        raise ValueError(
            f"{', '.join(indices)} must be int32 or int64; got "
            + ", ".join(str(t.dtype) for t in indices.values())
        )
    tensors = [query, k_cache, v_cache, *indices.values()]
    if out is not None:
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError(f"out must be like query; got {tuple(out.shape)} {out.dtype}")
        tensors.append(out)
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("every tensor must be a contiguous CPU tensor")


def window_and_softcap(window: int | None, softcap: float | None) -> tuple[int, float]:
    """The kernels' encoding of a sliding window and a soft cap (0: none), checked."""
    if window is not None and window < 1:
        raise ValueError(f"window must be positive, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    return window or 0, float(softcap or 0.0)
