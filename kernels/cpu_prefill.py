"""CPU paged-attention prefill: a C++ extension built at runtime, for the worker's CPU path.

Same contract as ``reference.paged_attention`` (cache layout in ``reference``) without
its per-sequence gather and SDPA: the kernel (``csrc/cpu_prefill.cpp``, register tiles in
``csrc/cpu_prefill_tiles.h``) reads K/V through each sequence's block table, one chunk
at a time, for all query heads of a KV head and a tile of query positions at once, with
an online softmax (flash-attention style), on torch's own intra-op thread pool. Causal
over cached context: plain prefill, chunked prefill, prefix-cache hits and decode rows
(query_len 1) alike. It is compiled on first use (``cpu_extension``); ``available()``
reports whether the build worked; callers fall back to the reference.
"""

from __future__ import annotations

import torch

from kernels.cpu_extension import CSRC, SCALAR_HEADER, LazyExtension, build_extension

_SOURCE = CSRC / "cpu_prefill.cpp"
_HEADERS = [CSRC / "cpu_prefill_tiles.h", SCALAR_HEADER]
OP_NAMESPACE = "pagoda_cpu_prefill"  # the source's default PAGODA_OP_NS
DTYPES = (torch.float32, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_HEAD_DIM = 256


def build_library(namespace: str = OP_NAMESPACE, defines: tuple[str, ...] = ()) -> None:
    """Compile (or load from the cache) the kernel as ``torch.ops.<namespace>``; tests
    build the portable path as a variant (``defines=("PAGODA_PORTABLE",)``)."""
    build_extension(namespace, _SOURCE, _HEADERS, defines=defines)


# a lambda: the source paths are read at build time
_extension = LazyExtension("cpu_prefill kernel", lambda: build_library())


def available() -> bool:
    """Build (once per process) and report whether the kernel can run; never raises."""
    return _extension.available()


def _check_shapes(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
) -> None:
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
    if seq_lens.ndim != 1:
        raise ValueError(f"seq_lens must be 1-D; got {tuple(seq_lens.shape)}")
    batch = seq_lens.shape[0]
    if query_start_loc.shape != (batch + 1,):
        raise ValueError(
            f"query_start_loc must be [{batch + 1}]; got {tuple(query_start_loc.shape)}"
        )
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [{batch}, max_blocks]; got {tuple(block_tables.shape)}"
        )


def _check(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Raise ValueError for anything the kernel would not read as documented."""
    _check_shapes(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    if query.dtype not in DTYPES or not query.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError(
            f"query, k_cache, v_cache must share a dtype in {DTYPES}; got "
            f"{query.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    indices = (query_start_loc, seq_lens, block_tables)
    if any(t.dtype not in INDEX_DTYPES for t in indices):
        raise ValueError(
            "query_start_loc, seq_lens and block_tables must be int32 or int64; got "
            + ", ".join(str(t.dtype) for t in indices)
        )
    tensors = [query, k_cache, v_cache, *indices]
    if out is not None:
        if out.shape != query.shape or out.dtype != query.dtype:
            raise ValueError(f"out must be like query; got {tuple(out.shape)} {out.dtype}")
        tensors.append(out)
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("every tensor must be a contiguous CPU tensor")


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: every sequence's new tokens
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [batch + 1] int32/int64: sequence i owns query[qsl[i]:qsl[i+1]]
    seq_lens: torch.Tensor,  # [batch] int32/int64: context + new tokens, all in the cache
    block_tables: torch.Tensor,  # [batch, max_blocks_per_seq] int32/int64
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], query dtype
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query dtype
    """Causal attention of each sequence's new tokens over its cached context and themselves.

    Query row j of sequence i sits at position ``seq_lens[i] - query_len_i + j`` and sees
    keys 0 .. that position. fp32 or bf16 in, fp32 accumulation (bf16: the softmax
    numerators are rounded to bf16 for P.V, as torch's flash attention does). Query head h
    reads KV head h // (num_heads // num_kv_heads). ``query_start_loc`` must be
    non-decreasing within [0, num_tokens], each ``seq_len`` at least its query_len and
    within its block-table row, every block id it reads in the cache (ValueError from the
    kernel otherwise); query rows outside every sequence are left as they are in ``out``.
    Raises RuntimeError when the extension did not build (check ``available()`` first).
    """
    _check(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out)
    if not available():
        raise RuntimeError("the cpu_prefill extension did not build; see the logged warning")
    if out is None:
        out = torch.empty_like(query)
    op = getattr(torch.ops, OP_NAMESPACE).prefill
    op(out, query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, float(scale))
    return out
