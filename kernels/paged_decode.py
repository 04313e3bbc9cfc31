"""Paged decode attention: one new token per sequence, K/V read through the block table.

Grid ``(batch, num_kv_heads, num_splits)``. A program holds all query heads of one
KV head as the rows of its query tile, so each K/V tile is loaded once for the whole
group (GQA). For long contexts and small batches the context is split across
``num_splits`` programs (split-K): each writes a partial output normalised by its own
softmax sum plus its log-sum-exp, and a second kernel merges the splits. Adapted idea:
SGLang ``triton_ops/decode_attention.py`` (two-stage grouped decode), itself after
lightllm; the split count heuristic is ours (``choose_num_splits``).

With a sliding window (``window``), a sequence's splits cover only the key tiles from
the one holding its first visible key; a soft cap (``softcap``) is applied per score.

Reference: ``reference.paged_decode_attention``.
"""

import torch

from kernels.attention_tile import LOG2E, attend_tile, check_window_and_softcap
from kernels.triton_utils import check_launchable, interpret_mode, next_pow2, tl, triton

# Aim for this many programs per SM before splitting stops paying (two waves hide the
# tail of the last one); splits shorter than min_tokens_per_split cost more in the
# reduce than they win in parallelism. Measured on an H200 with a floor of 512 keys a
# split: batch 1-8 at contexts <= 1k ran 0.29-0.38x torch SDPA, 2-16 programs walking
# their keys one tile after another on a 132-SM device. A floor of two 64-key tiles
# puts 8x more programs on those shapes; larger batches (>= 2 programs per SM) are
# not split at all, as before. To be re-measured by scripts/gpu_check.sh.
_PROGRAMS_PER_SM = 2
DEFAULT_MIN_TOKENS_PER_SPLIT = 128
DEFAULT_MAX_SPLITS = 32
_INTERPRETER_NUM_SMS = 4  # the interpreter has no SMs; pretend a small device


@triton.jit
def _decode_split_kernel(
    query_ptr,  # [batch, num_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM]
    block_tables_ptr,  # [batch, max_blocks_per_seq] int32
    seq_lens_ptr,  # [batch] int32, the new token included
    out_ptr,  # NUM_SPLITS == 1: [batch, num_heads, HEAD_DIM], the final output
    partial_ptr,  # NUM_SPLITS > 1: [batch, num_heads, NUM_SPLITS, HEAD_DIM] fp32
    lse_ptr,  # NUM_SPLITS > 1: [batch, num_heads, NUM_SPLITS] fp32, log2 domain
    qk_scale,  # softmax scale * log2(e)
    window,  # > 0: a decode token sees its last `window` keys only
    softcap,  # SOFTCAP: the soft cap * log2(e)
    stride_qb, stride_qh,  # query strides (batch, head)
    stride_ob, stride_oh,  # out strides (batch, head)
    stride_bt,  # block_tables row stride
    stride_block, stride_token, stride_head,  # cache strides (same for k and v)
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot minimum)
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    first_key = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)  # the window's start
    # splits own whole tiles: [start, end) of this sequence's keys, from first_key's tile on
    first_tile = first_key // TILE_N
    num_tiles = tl.cdiv(seq_len, TILE_N) - first_tile
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    start = (first_tile + split * tiles_per_split) * TILE_N
    end = tl.minimum(seq_len, start + tiles_per_split * TILE_N)

    offs_g = tl.arange(0, BLOCK_G)  # [BLOCK_G] rows: query heads of this KV head
    offs_d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    g_mask = offs_g < GROUP  # [BLOCK_G]
    heads = kv_head * GROUP + offs_g  # [BLOCK_G]
    q_offs = seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(query_ptr + q_offs, mask=g_mask[:, None], other=0.0)  # [BLOCK_G, HEAD_DIM]
    if UPCAST:
        q = q.to(tl.float32)
    key_limit = tl.where(g_mask, seq_len, 0)  # [BLOCK_G] a decode token sees all keys
    key_start = tl.zeros([BLOCK_G], tl.int32) + first_key  # [BLOCK_G] ... from first_key on

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # [BLOCK_G]
    l_i = tl.zeros([BLOCK_G], tl.float32)  # [BLOCK_G]
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)  # [BLOCK_G, HEAD_DIM]
    k_head_ptr = k_cache_ptr + kv_head * stride_head
    v_head_ptr = v_cache_ptr + kv_head * stride_head
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start_n in range(start, end, TILE_N):
        acc, m_i, l_i = attend_tile(
            q, acc, m_i, l_i, k_head_ptr, v_head_ptr, table_ptr, start_n, seq_len, key_start,
            key_limit, qk_scale, softcap, stride_block, stride_token, BLOCK_SIZE, TILE_N,
            HEAD_DIM, UPCAST, DOT_PREC, SOFTCAP,
        )

    # an empty split (short sequence in a long batch) has l = 0: weight 0 in the reduce
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # [BLOCK_G]
    o = acc / l_safe[:, None]  # [BLOCK_G, HEAD_DIM]
    if NUM_SPLITS == 1:
        o_offs = seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        row = (seq.to(tl.int64) * (GROUP * tl.num_programs(1)) + heads) * NUM_SPLITS + split
        tl.store(partial_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], o, mask=g_mask[:, None])
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # [BLOCK_G]
        tl.store(lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    partial_ptr,  # [batch, num_heads, NUM_SPLITS, HEAD_DIM] fp32, each split normalised
    lse_ptr,  # [batch, num_heads, NUM_SPLITS] fp32 log2-sum-exp2 of each split (-inf: empty)
    out_ptr,  # [batch, num_heads, HEAD_DIM]
    stride_ob, stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # NUM_SPLITS rounded up to a power of two
    HEAD_DIM: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    row = seq.to(tl.int64) * tl.num_programs(1) + head
    offs_s = tl.arange(0, SPLITS_PAD)  # [SPLITS_PAD]
    offs_d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    s_mask = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    # split 0 always holds keys (seq_len >= 1), so the max is finite
    weights = tl.exp2(lse - tl.max(lse, 0))  # [SPLITS_PAD], 0 for empty splits
    weights = weights / tl.sum(weights, 0)
    part_offs = (row * NUM_SPLITS + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]
    part = tl.load(partial_ptr + part_offs, mask=s_mask[:, None], other=0.0)  # [SPLITS_PAD, D]
    o = tl.sum(part * weights[:, None], 0)  # [HEAD_DIM]
    tl.store(out_ptr + seq.to(tl.int64) * stride_ob + head * stride_oh + offs_d,
             o.to(out_ptr.dtype.element_ty))


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    min_tokens_per_split: int = DEFAULT_MIN_TOKENS_PER_SPLIT,
    max_splits: int = DEFAULT_MAX_SPLITS,
) -> int:
    """Split-K factor (a power of two): split only when the batch alone cannot fill the
    device and each split still gets at least ``min_tokens_per_split`` keys."""
    programs = batch * num_kv_heads
    target = _PROGRAMS_PER_SM * num_sms
    if programs >= target:
        return 1
    splits = min(max_splits, -(-target // programs), max_seq_len // min_tokens_per_split)
    if splits <= 1:
        return 1
    return 1 << (splits.bit_length() - 1)  # round down: fewer compiled variants


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_NUM_SMS


def paged_decode_attention(
    query: torch.Tensor,  # [batch, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [batch] int32, the new token included
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [batch, num_heads, head_dim]
    num_splits: int | None = None,  # None: choose_num_splits
    min_tokens_per_split: int = DEFAULT_MIN_TOKENS_PER_SPLIT,
    tile_n: int = 64,
    window: int | None = None,  # sliding window: the last `window` keys only; None: all
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap); None: none
) -> torch.Tensor:  # [batch, num_heads, head_dim]
    """Triton version of ``reference.paged_decode_attention``."""
    check_launchable(query, k_cache, v_cache, block_tables, seq_lens)
    batch, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    _check_args(query, k_cache, v_cache, block_tables, seq_lens)
    out = torch.empty_like(query) if out is None else out
    if batch == 0:
        return out
    check_window_and_softcap(window, softcap)
    tile_n = max(16, tile_n)
    if num_splits is None:  # a window bounds the keys a sequence reads
        keys = max_seq_len if window is None else min(max_seq_len, window + tile_n)
        num_splits = choose_num_splits(
            batch, num_kv_heads, keys, _num_sms(query.device), min_tokens_per_split
        )
    group = num_heads // num_kv_heads
    upcast = interpret_mode()
    common = {
        "GROUP": group, "BLOCK_G": max(16, next_pow2(group)), "BLOCK_SIZE": block_size,
        "TILE_N": tile_n, "HEAD_DIM": head_dim, "NUM_SPLITS": num_splits,
        "UPCAST": upcast, "DOT_PREC": "ieee" if query.dtype == torch.float32 or upcast else "tf32",
        "SOFTCAP": softcap is not None,
    }
    if num_splits == 1:
        partial = lse = out  # unused by the kernel when NUM_SPLITS == 1
    else:
        partial = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32,
                              device=query.device)
        lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=query.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, partial, lse, scale * LOG2E,
        window or 0, (softcap or 0.0) * LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), **common,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            partial, lse, out, out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, SPLITS_PAD=next_pow2(num_splits), HEAD_DIM=head_dim,
        )
    return out


def _check_args(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    block_tables: torch.Tensor, seq_lens: torch.Tensor,
) -> None:
    """The kernel assumes what is checked here (dense head_dim, shared cache strides)."""
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"query {tuple(query.shape)} does not fit cache {tuple(k_cache.shape)}")
    if head_dim != next_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if query.stride(2) != 1 or k_cache.stride(3) != 1:
        raise ValueError("query and cache must be contiguous along head_dim")
    if block_tables.shape[0] < batch or seq_lens.shape[0] < batch:
        raise ValueError("block_tables and seq_lens need a row per sequence")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
