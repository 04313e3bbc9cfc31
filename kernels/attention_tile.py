"""The inner step shared by the decode and prefill kernels: one key tile of online softmax.

A program holds ``BLOCK_M`` query rows (the query heads of one KV head, for one or
several tokens) and walks the sequence's keys ``TILE_N`` positions at a time. Each
key position is found through the block table, so ``TILE_N`` is independent of the
cache block size (adapted idea: vLLM ``kernel_unified_attention_2d``, TILE_SIZE).
Scores live in the log2 domain (``qk_scale`` = softmax scale * log2(e)) so the
softmax uses ``exp2``, as FlashAttention-2 does. Each row sees the key positions in
``[key_start, key_limit)``: causal attention, and a sliding window where ``key_start``
is past 0. An optional soft cap maps scores to cap * tanh(score / cap) (Gemma 2), which
in the log2 domain is the same map with cap * log2(e).
"""

import math

from kernels.triton_utils import tl, triton

LOG2E = 1.0 / math.log(2.0)


def check_window_and_softcap(window: int | None, softcap: float | None) -> None:
    """The launchers' check of the optional sliding window and soft cap."""
    if window is not None and window < 1:
        raise ValueError(f"window must be positive, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")


@triton.jit
def tanh(x):
    """tanh to ~2e-7 relative: the odd Taylor series to x^9 below |x| = 0.25, else
    (1 - e) / (1 + e) with e = exp(-2|x|) (as the C++ kernels' tanh_f32)."""
    a = tl.abs(x)
    a2 = a * a
    small = a * (1.0 + a2 * (-0.333333333 + a2 * (0.133333333 + a2 * (-0.0539682540
                                                                     + a2 * 0.0218694885))))
    e = tl.exp(-2.0 * a)
    t = tl.where(a < 0.25, small, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0, -t, t)


@triton.jit
def attend_tile(
    q,  # [BLOCK_M, HEAD_DIM] queries of this program (dot dtype)
    acc,  # [BLOCK_M, HEAD_DIM] fp32 unnormalised output so far
    m_i,  # [BLOCK_M] fp32 running max of the log2-domain scores (-inf: none yet)
    l_i,  # [BLOCK_M] fp32 running sum of exp2(score - m_i)
    k_head_ptr,  # k_cache + kv_head * stride_head: [num_blocks, block_size, ., HEAD_DIM]
    v_head_ptr,  # v_cache + kv_head * stride_head
    block_table_ptr,  # [max_blocks_per_seq] int32: this sequence's row
    start_n,  # first key position of this tile
    seq_len,  # keys at positions >= seq_len are never loaded
    key_start,  # [BLOCK_M] int32: row r sees key positions >= key_start[r] (window)
    key_limit,  # [BLOCK_M] int32: row r sees key positions < key_limit[r]
    qk_scale,  # softmax scale * log2(e)
    softcap,  # SOFTCAP: the cap * log2(e) (scores are in the log2 domain)
    stride_block,  # cache stride between blocks (elements)
    stride_token,  # cache stride between tokens of a block
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    TILE_N: tl.constexpr,  # key positions per step
    HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr,  # compute the dots in fp32 (the interpreter has no bf16 dot)
    DOT_PREC: tl.constexpr,  # "ieee" for fp32 inputs (no silent tf32), else "tf32"
    SOFTCAP: tl.constexpr,  # apply softcap * tanh(s / softcap) to the scores
):
    offs_n = start_n + tl.arange(0, TILE_N)  # [TILE_N] key positions
    offs_d = tl.arange(0, HEAD_DIM)  # [HEAD_DIM]
    in_seq = offs_n < seq_len  # [TILE_N]
    # positions past seq_len would index past the sequence's last table entry
    block_ids = tl.load(block_table_ptr + offs_n // BLOCK_SIZE, mask=in_seq, other=0)  # [TILE_N]
    # int64: block_id * stride_block passes 2^31 elements on large caches
    token_offs = block_ids.to(tl.int64) * stride_block + (offs_n % BLOCK_SIZE) * stride_token
    kv_offs = token_offs[:, None] + offs_d[None, :]  # [TILE_N, HEAD_DIM]
    # masked loads read 0, never stale cache contents (a NaN there would poison p @ v)
    k = tl.load(k_head_ptr + kv_offs, mask=in_seq[:, None], other=0.0)  # [TILE_N, HEAD_DIM]
    v = tl.load(v_head_ptr + kv_offs, mask=in_seq[:, None], other=0.0)  # [TILE_N, HEAD_DIM]
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [BLOCK_M, TILE_N]
    if SOFTCAP:
        s = softcap * tanh(s / softcap)
    # [BLOCK_M, TILE_N]
    visible = (offs_n[None, :] < key_limit[:, None]) & (offs_n[None, :] >= key_start[:, None])
    s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
    # a row that has seen no key yet (padding rows) keeps m = -inf; subtract 0 instead
    # so that exp2 gives 0 rather than NaN from (-inf) - (-inf)
    m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # [BLOCK_M]
    p = tl.exp2(s - m_base[:, None])  # [BLOCK_M, TILE_N]
    alpha = tl.exp2(m_i - m_base)  # [BLOCK_M] rescales what was accumulated so far
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return acc, m_new, l_i
