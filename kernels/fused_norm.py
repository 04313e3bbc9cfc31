"""RMSNorm with an optional fused residual add, in Triton: the CUDA path of
``services/worker/layers/norm.py`` (the pre-norms of every decoder layer, the final
norm, and Qwen3 / Gemma 3's per-head q / k norms over head_dim).

One pass over memory: a program loads ROWS rows of x (and of the residual), stores
their sum, and writes the normalised rows. Short rows (head_dim) go several to a
program, long ones one; the row is padded to a power of two and masked, so any hidden
size works. Rounding as ``reference.rms_norm``, the layer's torch path: x + residual
rounded to x's dtype, the mean of squares and rsqrt in fp32, the normalised row rounded
to x's dtype and then times the weight (the fp32 product of the two values, rounded
once to the promoted dtype, as torch's ``weight * x``); Gemma's ``unit_offset`` scales
by the fp32 ``1 + w`` before the one rounding. The only differences from torch: the
order of the sum of squares, and the mean as ``sum * (1 / H)`` (torch's CUDA mean; its
CPU one divides), a few fp32 ulps. Launched with ``enable_fp_fusion=False``
so no multiply-add contracts into an FMA that torch's separate ops do not have.
Adapted idea: Liger Kernel ``ops/rms_norm.py`` (rows per program, fp32 in registers).
"""

from __future__ import annotations

import torch

from kernels.triton_utils import check_launchable, interpret_mode, next_pow2, round_to, tl, triton

# the interpreter's bf16 cast truncates (triton_utils.round_to); read when the kernels
# below are decorated, as Triton reads TRITON_INTERPRET
_RNE_BY_HAND = interpret_mode()


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_rows, H], rows stride_x apart, unit stride along H
    residual_ptr,  # [num_rows, H], rows stride_r apart (x_ptr without a residual)
    weight_ptr,  # [H]: w, or with UNIT_OFFSET the fp32 1 + w
    out_ptr,  # [num_rows, H] contiguous: the normalised rows (promoted dtype)
    sum_ptr,  # [num_rows, H] contiguous, x's dtype: x + residual (unused without one)
    num_rows,
    stride_x,
    stride_r,
    eps,  # fp32
    inv_h,  # fp32: 1 / H (the mean as torch's CUDA reduction takes it: sum * (1 / H))
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,  # H rounded up to a power of two
    ROWS: tl.constexpr,  # rows per program
    HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,  # interpreter: see triton_utils.round_to
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    cols = tl.arange(0, BLOCK_H)  # [BLOCK_H]
    col_mask = cols < H
    mask = (rows < num_rows)[:, None] & col_mask[None, :]  # [ROWS, BLOCK_H]
    rows64 = rows.to(tl.int64)[:, None]  # [ROWS, 1]: row offsets past 2^31 elements
    x_dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)  # [ROWS, BLOCK_H]
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + rows64 * stride_r + cols[None, :], mask=mask, other=0.0)
        s = round_to(x + r.to(tl.float32), x_dtype, RNE_BY_HAND)  # torch's add
        tl.store(sum_ptr + rows64 * H + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=1) * inv_h  # [ROWS]: mean of squares (masked lanes are 0)
    xn = x * tl.rsqrt(var + eps)[:, None]  # [ROWS, BLOCK_H] fp32
    w = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if UNIT_OFFSET:
        y = xn * w  # (1 + w) in fp32, rounded once below
    else:
        y = round_to(xn, x_dtype, RNE_BY_HAND).to(tl.float32) * w
    out = round_to(y, out_ptr.dtype.element_ty, RNE_BY_HAND)
    tl.store(out_ptr + rows64 * H + cols[None, :], out, mask=mask)


def _rows_2d(t: torch.Tensor, h: int) -> torch.Tensor:  # [..., H] -> [rows, H], unit col stride
    t2 = t.reshape(-1, h)  # a view where the layout allows (2-D strided rows always do)
    return t2 if t2.stride(1) == 1 or t2.shape[0] == 0 else t2.contiguous()


def launch_config(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_H, ROWS, num_warps) for rows of ``hidden`` elements: a tile of about a
    thousand elements or one whole row, whichever is larger (untuned on hardware)."""
    block_h = next_pow2(hidden)
    rows = max(1, min(16, 1024 // block_h))
    tile = rows * block_h
    num_warps = 4 if tile <= 2048 else 8 if tile <= 8192 else 16
    return block_h, rows, num_warps


def rms_norm(
    x: torch.Tensor,  # [..., H], unit stride along H (any row stride)
    residual: torch.Tensor | None,  # like x (shape and dtype), or None
    weight: torch.Tensor,  # [H]; with unit_offset, the fp32 1 + w (RMSNorm.offset_weight)
    eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # norm(x + residual) [..., H], x + residual [..., H]
    """``reference.rms_norm`` in one launch: new contiguous outputs; residual None returns
    x itself as the new residual, as the torch path does."""
    check_launchable(x, weight, *(() if residual is None else (residual,)))
    h = x.shape[-1]
    if weight.shape != (h,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be a dense [{h}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({tuple(x.shape)}, {x.dtype}), got "
                         f"{tuple(residual.shape)}, {residual.dtype}")
    x2 = _rows_2d(x, h)
    out_dtype = x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x2.shape, dtype=out_dtype, device=x.device)
    if residual is None:
        r2 = new_residual = x2  # placeholders: HAS_RESIDUAL is off
    else:
        r2 = _rows_2d(residual, h)
        new_residual = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    num_rows = x2.shape[0]
    if num_rows:
        block_h, rows, num_warps = launch_config(h)
        _rms_norm_kernel[(triton.cdiv(num_rows, rows),)](
            x2, r2, weight, out, new_residual, num_rows, x2.stride(0), r2.stride(0),
            eps, 1.0 / h, H=h, BLOCK_H=block_h, ROWS=rows, HAS_RESIDUAL=residual is not None,
            UNIT_OFFSET=unit_offset, RNE_BY_HAND=_RNE_BY_HAND, num_warps=num_warps,
            enable_fp_fusion=False,
        )
    if residual is None:
        return out.view(x.shape), x
    return out.view(x.shape), new_residual.view(x.shape)
