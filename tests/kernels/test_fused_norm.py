"""The Triton RMSNorm (kernels.fused_norm) against ``reference.rms_norm``, the torch path
of ``layers/norm.py`` (in Triton's interpreter without a GPU).

Cases: fp32 / fp16 / bf16; hidden 96 (eight rows to a program, the last program partly
masked) and 1000 (one row to a program), neither a power of two, x as strided rows of
a wider buffer; residual None (x itself comes back) and given (x + residual must equal
torch's add bit for bit); plain weights and Gemma's unit_offset (the fp32 1 + w); a
bf16 x with an fp32 weight (fp32 output, as torch promotes); the per-head rows of
Qwen3's q / k norms (head_dim 64 / 128, many short rows); no rows. Then the layer:
RMSNorm with its Triton path forced onto CPU tensors equals its torch path, and the
fp32 -> bf16 rounding helper (``triton_utils.round_to``) equals torch's cast.

Tolerances: the sum of squares runs in another order than torch's, a few fp32 ulps;
fp32 outputs within 4 eps relative. In bf16 / fp16 that moves the normalised value
across a rounding tie only rarely: within 2 eps relative after the weight, on at most
1 % of the elements. Measured (64 rows, hidden 96 / 1000 / 4096): bf16 100 % of the
outputs bit-identical, fp16 >= 99.99 %, fp32 63-87 %; x + residual 100 % in all three.
"""

from __future__ import annotations

import pytest
import torch
from fused_cases import compare, force_triton_path, spy

from kernel_cases import DTYPES, device, require_triton, skip_unless_runnable
from kernels import reference
from kernels.triton_utils import interpret_mode, round_to, tl, triton

pytestmark = require_triton

EPS_UNITS = {torch.float32: 4.0, torch.float16: 2.0, torch.bfloat16: 2.0}


def _inputs(num_rows: int, hidden: int, dtype: torch.dtype, with_residual: bool,
            unit_offset: bool, gen: torch.Generator
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """x and residual as the first `hidden` columns of wider rows (strided), a weight."""
    dev = device()
    x = (3 * torch.randn(num_rows, hidden + 7, generator=gen)).to(dev, dtype)[:, :hidden]
    residual = None
    if with_residual:
        residual = torch.randn(num_rows, hidden + 3, generator=gen).to(dev, dtype)[:, :hidden]
    w = 0.2 * torch.randn(hidden, generator=gen)
    weight = 1.0 + w if unit_offset else (1.0 + w).to(dtype)  # RMSNorm.offset_weight: fp32
    return x, residual, weight.to(dev)


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
           unit_offset: bool, what: str) -> float:
    from kernels.fused_norm import rms_norm

    out, new_residual = rms_norm(x, residual, weight, 1e-6, unit_offset)
    ref_out, ref_residual = reference.rms_norm(x, residual, weight, 1e-6, unit_offset)
    if residual is None:
        assert new_residual is x, "without a residual, x itself is the new residual"
    else:
        assert torch.equal(new_residual, ref_residual), f"{what}: x + residual must round as torch"
    dtype = ref_out.dtype
    return compare(out, ref_out, what, eps_units=EPS_UNITS[dtype],
                   max_off=1.0 if dtype == torch.float32 else 0.01)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("unit_offset", [False, True])
def test_rms_norm(dtype: torch.dtype, hidden: int, with_residual: bool, unit_offset: bool) -> None:
    skip_unless_runnable()
    gen = torch.Generator().manual_seed(hidden + 2 * with_residual + unit_offset)
    x, residual, weight = _inputs(11, hidden, dtype, with_residual, unit_offset, gen)
    _check(x, residual, weight, unit_offset, f"rms_norm {dtype} H={hidden}")


def test_rms_norm_promotes_to_the_weight_dtype() -> None:
    """A bf16 x with an fp32 weight: torch's ``weight * x.to(bf16)`` is fp32."""
    skip_unless_runnable()
    gen = torch.Generator().manual_seed(3)
    x, residual, _ = _inputs(5, 96, torch.bfloat16, True, False, gen)
    weight = 1.0 + 0.2 * torch.randn(96, generator=gen)
    _check(x, residual, weight.to(x.device), False, "bf16 x, fp32 weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rms_norm_per_head_rows(dtype: torch.dtype, head_dim: int) -> None:
    """Qwen3's q_norm: every head of every token one short row (llama.py's reshape)."""
    skip_unless_runnable()
    gen = torch.Generator().manual_seed(head_dim)
    num_tokens, num_heads, num_kv_heads = 5, 6, 2
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    q = qkv.to(device(), dtype)[:, : num_heads * head_dim]  # strided rows, as split off qkv
    weight = (1.0 + 0.2 * torch.randn(head_dim, generator=gen)).to(device(), dtype)
    _check(q.reshape(num_tokens * num_heads, head_dim), None, weight, False, "q_norm")
    # a 3-D view of q (no copy), normalised over its last dim
    _check(q.view(num_tokens, num_heads, head_dim), None, weight, False, "q_norm 3-D")


def test_rms_norm_no_rows() -> None:
    skip_unless_runnable()
    from kernels.fused_norm import rms_norm

    x = torch.empty(0, 96, device=device())
    out, new_residual = rms_norm(x, torch.empty_like(x), torch.ones(96, device=x.device), 1e-6)
    assert out.shape == (0, 96) and new_residual.shape == (0, 96)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", [False, True])
def test_layer_triton_path_equals_its_torch_path(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, unit_offset: bool
) -> None:
    skip_unless_runnable()
    from kernels import fused_norm
    from services.worker.layers import norm as norm_module
    from services.worker.layers.norm import RMSNorm

    asked = force_triton_path(monkeypatch, norm_module)
    launched = spy(monkeypatch, fused_norm, "rms_norm")
    gen = torch.Generator().manual_seed(7)
    dev = device()
    fused, plain = (RMSNorm(200, 1e-5, fused=f, unit_offset=unit_offset).to(dev)
                    for f in (True, False))
    weight = (0.2 * torch.randn(200, generator=gen)).to(dev, dtype)
    for module in (fused, plain):
        module.weight.data = weight.clone()
        module.finish_loading()
    x = torch.randn(9, 200, generator=gen).to(dev, dtype)
    residual = torch.randn(9, 200, generator=gen).to(dev, dtype)
    for res in (None, residual):
        out, new_residual = fused(x, res)
        ref_out, ref_residual = plain(x, res)
        assert torch.equal(new_residual, ref_residual)
        compare(out, ref_out, f"RMSNorm {dtype}", eps_units=EPS_UNITS[dtype], max_off=1.0)
    assert len(launched) == 2, "the fused module must launch the kernel, once a call"
    assert set(asked) == {(x.device, dtype)}, asked


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, round_to(x, out_ptr.dtype.element_ty, RNE_BY_HAND), mask=offs < n)


def test_round_to_bf16_is_torchs_cast() -> None:
    """Ties both ways, the largest finite values (to inf), subnormals, inf, NaN, -0."""
    skip_unless_runnable()
    ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x3F808001, 0x7F7FFFFF,
                         0x7F7F8000, 0x00008000, 0x00018000, 0x00000001], dtype=torch.int64)
    special = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1e-40])
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([ties.to(torch.int32).view(torch.float32), special,
                   torch.randn(200, generator=gen) * 10.0 ** torch.randint(-30, 30, (200,),
                                                                         generator=gen)])
    x = x.to(device())
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    _round_kernel[(1,)](x, out, x.numel(), BLOCK=256, RNE_BY_HAND=interpret_mode())
    ref, out = x.to(torch.bfloat16).cpu(), out.cpu()
    assert torch.equal(out.view(torch.int16)[~ref.isnan()], ref.view(torch.int16)[~ref.isnan()])
    assert out.isnan().equal(ref.isnan())
