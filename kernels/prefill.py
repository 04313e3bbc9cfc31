"""Varlen causal prefill attention over paged context (chunked prefill, prefix-cache hits).

Each sequence's ``query_len`` new tokens attend causally to its ``seq_len`` keys:
the cached context (``seq_len - query_len`` tokens) and the new tokens themselves,
whose K/V must already be in the cache (the cache write runs first). Everything is
read through the block table, so a fresh prompt, a later chunk and a prompt after a
prefix hit are one code path.

Grid ``(cdiv(max_query_len, BLOCK_Q), num_seqs, num_kv_heads)``: the query tiles on
axis 0, whose CUDA limit is 2^31 - 1 (a long prompt with many query heads per KV head
has one row a tile and could pass axis 1's 65,535). The query tile packs
``BLOCK_Q`` tokens x ``GROUP`` query heads of one KV head as its ``BLOCK_M`` rows
(token-major), so each K/V tile is loaded once per group (GQA). Adapted idea: vLLM
``kernel_unified_attention_2d`` (query heads of a KV head packed into the M dimension).
With ``query_len == 1`` it computes a decode as well; the backend uses the dedicated
decode kernel (split-K) for those.

A sliding window (``window``) starts each program's key walk at its first row's first
visible key and masks per row; a soft cap (``softcap``) is applied per score.

Reference: ``reference.paged_attention``.
"""

import torch

from kernels.attention_tile import LOG2E, attend_tile, check_window_and_softcap
from kernels.triton_utils import check_launchable, interpret_mode, next_pow2, tl, triton


@triton.jit
def _prefill_kernel(
    query_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    query_start_loc_ptr,  # [num_seqs + 1] int32: absolute token index of each sequence's start
    seq_lens_ptr,  # [num_seqs] int32: context + new tokens
    block_tables_ptr,  # [num_seqs, max_blocks_per_seq] int32
    out_ptr,  # [num_tokens, num_heads, HEAD_DIM]
    qk_scale,  # softmax scale * log2(e)
    window,  # > 0: the token at position p sees keys p - window < j <= p only
    softcap,  # SOFTCAP: the soft cap * log2(e)
    stride_qt, stride_qh,  # query strides (token, head)
    stride_ot, stride_oh,  # out strides (token, head)
    stride_bt,  # block_tables row stride
    stride_block, stride_token, stride_head,  # cache strides (same for k and v)
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_M: tl.constexpr,  # rows per program (power of two >= 16)
    BLOCK_Q: tl.constexpr,  # query tokens per program: BLOCK_M // GROUP
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    q_tile = tl.program_id(0)  # axis 0: up to 2^31 - 1 (axes 1 and 2: 65,535 on CUDA)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= query_len:  # the grid covers the longest sequence only
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M] rows: token-major, head-minor
    offs_d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    q_idx = q_tile * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] index among the new tokens
    heads = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    # BLOCK_M need not be a multiple of GROUP: the rows past BLOCK_Q * GROUP are idle
    row_mask = (offs_m < BLOCK_Q * GROUP) & (q_idx < query_len)  # [BLOCK_M]
    tokens = (q_start + q_idx).to(tl.int64)  # [BLOCK_M] absolute token index
    q_offs = tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(query_ptr + q_offs, mask=row_mask[:, None], other=0.0)  # [BLOCK_M, HEAD_DIM]
    if UPCAST:
        q = q.to(tl.float32)
    # causal: the token at position context_len + i sees keys 0 .. context_len + i
    key_limit = tl.where(row_mask, context_len + q_idx + 1, 0)  # [BLOCK_M]
    # sliding window: it sees keys from context_len + i - window + 1 on
    key_start = tl.where(window > 0, tl.maximum(context_len + q_idx - window + 1, 0), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # [BLOCK_M]
    l_i = tl.zeros([BLOCK_M], tl.float32)  # [BLOCK_M]
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # [BLOCK_M, HEAD_DIM]
    k_head_ptr = k_cache_ptr + kv_head * stride_head
    v_head_ptr = v_cache_ptr + kv_head * stride_head
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # keys past the last row's causal limit are invisible to the whole tile
    kv_end = tl.minimum(seq_len, context_len + (q_tile + 1) * BLOCK_Q)
    # and keys before the first row's window start are invisible to the whole tile
    kv_start = tl.where(window > 0, tl.maximum(context_len + q_tile * BLOCK_Q - window + 1, 0), 0)
    for start_n in range(kv_start, kv_end, TILE_N):
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_head_ptr, v_head_ptr, table_ptr, start_n, seq_len, key_start,
            key_limit, qk_scale, softcap, stride_block, stride_token, BLOCK_SIZE, TILE_N,
            HEAD_DIM, UPCAST, DOT_PREC, SOFTCAP,
        )

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # idle rows have l = 0 (and are not stored)
    o = acc / l_safe[:, None]  # [BLOCK_M, HEAD_DIM]
    o_offs = tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: all new tokens, flattened
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, absolute indexes into query
    seq_lens: torch.Tensor,  # [num_seqs] int32: context + new tokens
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    block_m: int = 64,
    tile_n: int = 64,
    window: int | None = None,  # sliding window: keys p - window < j <= p; None: all
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap); None: none
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]; rows of other sequences untouched
    """Triton version of ``reference.paged_attention`` for the sequences given.

    ``query_start_loc`` may be a slice of the step's (the prefills after the decodes):
    its values index ``query`` and ``out`` directly.
    """
    check_launchable(query, k_cache, v_cache, query_start_loc, seq_lens, block_tables)
    _, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if num_heads % num_kv_heads or head_dim != next_pow2(head_dim) or head_dim < 16:
        raise ValueError(
            f"unsupported heads/head_dim: {tuple(query.shape)} vs {tuple(k_cache.shape)}"
        )
    if query.stride(2) != 1 or k_cache.stride(3) != 1 or block_tables.stride(1) != 1:
        raise ValueError("query, cache and block_tables must be contiguous in their last dim")
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] < num_seqs:
        raise ValueError("query_start_loc needs num_seqs + 1 entries, block_tables num_seqs rows")
    check_window_and_softcap(window, softcap)
    out = torch.empty_like(query) if out is None else out
    if num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    block_m = max(16, block_m, next_pow2(group))
    block_q = block_m // group
    upcast = interpret_mode()
    grid = (-(-max_query_len // block_q), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query, k_cache, v_cache, query_start_loc, seq_lens, block_tables, out, scale * LOG2E,
        window or 0, (softcap or 0.0) * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_SIZE=block_size,
        TILE_N=max(16, tile_n), HEAD_DIM=head_dim, UPCAST=upcast,
        DOT_PREC="ieee" if query.dtype == torch.float32 or upcast else "tf32",
        SOFTCAP=softcap is not None,
    )
    return out
