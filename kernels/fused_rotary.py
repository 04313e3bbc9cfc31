"""Rotary embedding of q and k in place, in Triton: the CUDA path of
``services/worker/layers/rotary.py``.

One launch, one program per token: it reads the token's cos / sin row (row
``index[t]`` of the tables the module would index: its cached tables by position, or a
``RopePlan``'s rows for dynamic / longrope, so every rope type the module supports runs
here) and rotates all of the token's query heads, then all of its key heads, writing
back where it read. Rotate-half layout as HF Llama; with partial rotary only the first
``rotary_dim`` dims of a head turn (``rotary_dim = 2 * table width``) and the rest are
never touched. q and k are the views llama.py splits off the fused qkv output (strided
rows), so each comes with its own token and head strides. Rounding as
``reference.rotary``: ``x1 * cos - x2 * sin`` in fp32 with each product rounded (the
launch sets ``enable_fp_fusion=False``, no FMA), then one rounding to the input dtype;
the result equals torch's bit for bit. Adapted idea: Liger Kernel ``ops/rope.py``.
"""

from __future__ import annotations

import torch

from kernels.triton_utils import check_launchable, interpret_mode, next_pow2, round_to, tl, triton

# the interpreter's bf16 cast truncates (triton_utils.round_to); read when the kernels
# below are decorated, as Triton reads TRITON_INTERPRET
_RNE_BY_HAND = interpret_mode()


@triton.jit
def _rotate_heads(
    ptr,  # the token's first head: [NUM_HEADS, head_dim], heads stride_h apart
    stride_h,
    cos,  # [1, HALF_PAD] fp32 (0 past HALF)
    sin,  # [1, HALF_PAD] fp32
    offs_d,  # [HALF_PAD]
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # NUM_HEADS rounded up to a power of two
    HALF: tl.constexpr,  # rotary_dim / 2
    RNE_BY_HAND: tl.constexpr,
):
    heads = tl.arange(0, HEADS_PAD)  # [HEADS_PAD]
    mask = (heads < NUM_HEADS)[:, None] & (offs_d < HALF)[None, :]  # [HEADS_PAD, HALF_PAD]
    first = ptr + heads[:, None] * stride_h + offs_d[None, :]  # dims [0, HALF) of each head
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)  # [HEADS_PAD, HALF_PAD]
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)  # dims [HALF, 2 HALF)
    dtype = ptr.dtype.element_ty
    tl.store(first, round_to(x1 * cos - x2 * sin, dtype, RNE_BY_HAND), mask=mask)
    tl.store(first + HALF, round_to(x2 * cos + x1 * sin, dtype, RNE_BY_HAND), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, NUM_Q_HEADS, head_dim]: strides (stride_qt, stride_qh, 1)
    k_ptr,  # [T, NUM_K_HEADS, head_dim]: strides (stride_kt, stride_kh, 1)
    index_ptr,  # [T] int: token t rotates with table row index[t]
    cos_ptr,  # [rows, HALF]: rows stride_cos apart, unit stride along HALF
    sin_ptr,  # [rows, HALF]: rows stride_sin apart
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    NUM_Q_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,  # HALF rounded up to a power of two
    RNE_BY_HAND: tl.constexpr,  # interpreter: see triton_utils.round_to
):
    t = tl.program_id(0).to(tl.int64)
    row = tl.load(index_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF_PAD)  # [HALF_PAD]
    d_mask = offs_d < HALF
    cos = tl.load(cos_ptr + row * stride_cos + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(sin_ptr + row * stride_sin + offs_d, mask=d_mask, other=0.0)
    cos = cos.to(tl.float32)[None, :]  # [1, HALF_PAD]
    sin = sin.to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, cos, sin, offs_d,
                  NUM_Q_HEADS, Q_HEADS_PAD, HALF, RNE_BY_HAND)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, cos, sin, offs_d,
                  NUM_K_HEADS, K_HEADS_PAD, HALF, RNE_BY_HAND)


def rotary_inplace(
    query: torch.Tensor,  # [T, num_heads, head_dim], unit stride along head_dim
    key: torch.Tensor,  # [T, num_kv_heads, head_dim], likewise, query's dtype
    index: torch.Tensor,  # [T] int64 / int32: each token's table row, < rows (unchecked)
    cos_table: torch.Tensor,  # [rows, rotary_dim / 2] float, unit stride along a row
    sin_table: torch.Tensor,  # [rows, rotary_dim / 2], likewise
) -> None:
    """``reference.rotary`` written into ``query`` and ``key`` (one launch); an index
    past the tables is not checked (the torch path raises there)."""
    check_launchable(query, key, index, cos_table, sin_table)
    if query.dim() != 3 or key.dim() != 3 or key.shape[0] != query.shape[0] \
            or key.shape[2] != query.shape[2] or key.dtype != query.dtype:
        raise ValueError(f"query [T, H, D] and key [T, H_kv, D] of one dtype expected, got "
                         f"{tuple(query.shape)} {query.dtype}, {tuple(key.shape)} {key.dtype}")
    if query.stride(2) != 1 or key.stride(2) != 1:
        raise ValueError(f"query and key need unit stride along head_dim, got "
                         f"{query.stride()}, {key.stride()}")
    num_tokens, num_heads, head_dim = query.shape
    half = cos_table.shape[-1]
    if cos_table.dim() != 2 or sin_table.shape != cos_table.shape or 2 * half > head_dim \
            or cos_table.stride(1) != 1 or sin_table.stride(1) != 1:
        raise ValueError(f"cos / sin tables must be [rows, rotary_dim / 2 <= {head_dim // 2}] "
                         f"with unit column stride, got {tuple(cos_table.shape)}, "
                         f"{tuple(sin_table.shape)}")
    if index.shape != (num_tokens,):
        raise ValueError(f"index must be [{num_tokens}], got {tuple(index.shape)}")
    if num_tokens == 0 or half == 0:
        return
    num_kv_heads = key.shape[1]
    half_pad = next_pow2(half)
    tile = next_pow2(max(num_heads, num_kv_heads)) * half_pad
    _rotary_kernel[(num_tokens,)](
        query, key, index, cos_table, sin_table, query.stride(0), query.stride(1),
        key.stride(0), key.stride(1), cos_table.stride(0), sin_table.stride(0),
        NUM_Q_HEADS=num_heads, Q_HEADS_PAD=next_pow2(num_heads), NUM_K_HEADS=num_kv_heads,
        K_HEADS_PAD=next_pow2(num_kv_heads), HALF=half, HALF_PAD=half_pad,
        RNE_BY_HAND=_RNE_BY_HAND, num_warps=4 if tile <= 4096 else 8,
        enable_fp_fusion=False,
    )
