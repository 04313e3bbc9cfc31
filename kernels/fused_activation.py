"""The gated MLP activation in Triton, ``act(gate) * up`` from the fused gate_up
projection: the CUDA path of ``LlamaMLP.forward`` (``services/worker/models/llama.py``).

Grid (tokens, column blocks of the intermediate size I): a program reads BLOCK gate
columns and the matching up columns of one ``[2 I]`` row and writes BLOCK outputs.
Rounding as ``reference.act_mul`` (torch's ``F.silu(gate) * up``): the activation in
fp32, rounded to the dtype, then the fp32 product with up rounded once. SiLU is
``g / (1 + exp(-g))`` (IEEE division, as torch's kernels); GeGLU's tanh GELU is
torch's ``0.5 g (1 + tanh(u))``, ``u = sqrt(2 / pi) (g + 0.044715 g^3)``, op for op,
with ``tanh`` built from ``exp`` (``tl`` has none). The exp and tanh differ from torch's
by an fp32 ulp or so, which moves a bf16 result only when it sits at a rounding tie
(and GELU's far negative tail, |u| > 8, where ``1 + tanh`` is a few fp32 ulps of 1 in
torch too). Launched with ``enable_fp_fusion=False`` (no FMA where torch rounds twice).
Adapted idea: Liger Kernel ``ops/swiglu.py``.
"""

from __future__ import annotations

import torch

from kernels.triton_utils import check_launchable, interpret_mode, next_pow2, round_to, tl, triton

# the interpreter's bf16 cast truncates (triton_utils.round_to); read when the kernels
# below are decorated, as Triton reads TRITON_INTERPRET
_RNE_BY_HAND = interpret_mode()

MAX_BLOCK = 1024


@triton.jit
def _act_mul_kernel(
    gate_up_ptr,  # [T, 2 I]: rows stride_in apart, unit column stride; gate | up
    out_ptr,  # [T, I]: rows stride_out apart
    stride_in,
    stride_out,
    inter,  # I, the intermediate size
    BLOCK: tl.constexpr,  # output columns per program (a power of two)
    GELU: tl.constexpr,  # tanh GELU (GeGLU), else SiLU (SwiGLU)
    RNE_BY_HAND: tl.constexpr,  # interpreter: see triton_utils.round_to
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    mask = cols < inter
    gate_ptr = gate_up_ptr + row * stride_in
    g = tl.load(gate_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # [BLOCK]
    u = tl.load(gate_ptr + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        # sqrt(2 / pi) and 0.044715 as torch's kBeta, kKappa (fp32), in torch's order
        inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
        # tanh from exp, |tanh| as 1 - 2e / (1 + e): near +-1 (the tails) that is nearly
        # always the correctly rounded value, as torch's tanh, so 1 + tanh rounds alike
        e = tl.exp(-2.0 * tl.abs(inner))
        t = 1.0 - tl.div_rn(2.0 * e, 1.0 + e)
        t = tl.where(inner < 0, -t, t)
        act = 0.5 * g * (1.0 + t)
    else:
        act = tl.div_rn(g, 1.0 + tl.exp(-g))
    dtype = out_ptr.dtype.element_ty
    act = round_to(act, dtype, RNE_BY_HAND).to(tl.float32)  # F.silu's output
    tl.store(out_ptr + row * stride_out + cols, round_to(act * u, dtype, RNE_BY_HAND),
             mask=mask)


def act_mul(
    gate_up: torch.Tensor,  # [..., 2 I], unit stride along the row
    gelu: bool = False,  # tanh GELU (Gemma's GeGLU); SiLU otherwise
) -> torch.Tensor:  # [..., I] contiguous, gate_up's dtype
    """``reference.act_mul`` in one launch."""
    check_launchable(gate_up)
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"gate_up's last dim must be even (gate | up), got {width}")
    inter = width // 2
    x = gate_up.reshape(-1, width)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if out.numel():
        block = min(MAX_BLOCK, next_pow2(inter))
        _act_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), inter, BLOCK=block, GELU=gelu,
            RNE_BY_HAND=_RNE_BY_HAND, num_warps=4, enable_fp_fusion=False,
        )
    return out.view(*gate_up.shape[:-1], inter)
