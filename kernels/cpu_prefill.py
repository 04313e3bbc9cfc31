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

from kernels.cpu_attention_checks import check_buffers, check_heads, window_and_softcap
from kernels.cpu_extension import CSRC, SCALAR_HEADER, LazyExtension, build_extension

_SOURCE = CSRC / "cpu_prefill.cpp"
_HEADERS = [CSRC / "cpu_attention_types.h", CSRC / "cpu_prefill_tiles.h", CSRC / "cpu_softmax_avx2.h",
            SCALAR_HEADER]
OP_NAMESPACE = "pagoda_cpu_prefill"  # the source's default PAGODA_OP_NS


def build_library(namespace: str = OP_NAMESPACE, defines: tuple[str, ...] = ()) -> None:
    """Compile (or load from the cache) the kernel as ``torch.ops.<namespace>``; tests
    build the portable path as a variant (``defines=("PAGODA_PORTABLE",)``)."""
    build_extension(namespace, _SOURCE, _HEADERS, defines=defines)


# a lambda: the source paths are read at build time
_extension = LazyExtension("cpu_prefill kernel", lambda: build_library())


def available() -> bool:
    """Build (once per process) and report whether the kernel can run; never raises."""
    return _extension.available()


def _check(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
    out: torch.Tensor | None,
) -> None:
    """Raise ValueError for anything the kernel would not read as documented."""
    check_heads(query, k_cache, v_cache)
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
    indices = {"query_start_loc": query_start_loc, "seq_lens": seq_lens,
               "block_tables": block_tables}
    check_buffers(query, k_cache, v_cache, indices, out)


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: every sequence's new tokens
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [batch + 1] int32/int64: sequence i owns query[qsl[i]:qsl[i+1]]
    seq_lens: torch.Tensor,  # [batch] int32/int64: context + new tokens, all in the cache
    block_tables: torch.Tensor,  # [batch, max_blocks_per_seq] int32/int64
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim], query dtype
    *,
    window: int | None = None,  # sliding window: keys p - window < j <= p; None: all
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap); None: none
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim], query dtype
    """Causal attention of each sequence's new tokens over its cached context and themselves.

    Query row j of sequence i sits at position ``seq_lens[i] - query_len_i + j`` and sees
    keys 0 .. that position (the last ``window`` of them with a window). fp32 or bf16 in, fp32 accumulation (bf16: the softmax
    numerators are rounded to bf16 for P.V, as torch's flash attention does). Query head h
    reads KV head h // (num_heads // num_kv_heads). ``query_start_loc`` must be
    non-decreasing within [0, num_tokens], each ``seq_len`` at least its query_len and
    within its block-table row, every block id it reads in the cache (ValueError from the
    kernel otherwise); query rows outside every sequence are left as they are in ``out``.
    Raises RuntimeError when the extension did not build (check ``available()`` first).
    """
    _check(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out)
    window_arg, softcap_arg = window_and_softcap(window, softcap)
    if not available():
        raise RuntimeError("the cpu_prefill extension did not build; see the logged warning")
    if out is None:
        out = torch.empty_like(query)
    op = getattr(torch.ops, OP_NAMESPACE).prefill
    op(out, query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, float(scale),
       window_arg, softcap_arg)
    return out
