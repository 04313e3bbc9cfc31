"""The Triton gated activation (kernels.fused_activation) against ``reference.act_mul``,
torch's ``F.silu(gate) * up`` / ``F.gelu(gate, approximate="tanh") * up`` (in Triton's
interpreter without a GPU).

Cases: fp32 / fp16 / bf16, SiLU and tanh GELU, intermediate 200 (one masked column
block) and 1500 (two), gate_up as strided rows of a wider buffer, a 3-D input, the
special values (+-inf, NaN, +-0, huge and tiny gates), no rows. Then LlamaMLP with its
Triton path forced onto CPU tensors, against its torch path (``fused=False``).

Tolerances: the kernel rounds where torch rounds; only its fp32 exp (and GELU's tanh,
built from exp) differ from torch's by an ulp or so. fp32: within 4 eps relative, plus
an absolute 2^-24 |g| for GELU's far negative tail (where 1 + tanh is a few ulps of 1
in torch too). bf16 / fp16: the rounded activation moves by one ulp only where the fp32
value sits at a tie, so the product lies within 2 eps relative (or the tail's absolute
bound), on at most 1 % (SiLU) / 2 % (GELU) of the elements. Measured (64 rows, I 1500 /
4000): SiLU bit-identical on 100 % of bf16, 99.98 % of fp16, 84 % of fp32 outputs; GELU
on 99.6 %, 99.7 %, 90 %.
"""

from __future__ import annotations

import pytest
import torch
from fused_cases import EPS, compare, force_triton_path, spy

from kernel_cases import DTYPES, device, require_triton, skip_unless_runnable
from kernels import reference
from kernels.triton_utils import interpret_mode
from tests.support.model_configs import mlp_config

pytestmark = require_triton

MAX_OFF = {False: 0.01, True: 0.02}  # bf16 / fp16, by gelu
# Compiled (CUDA), tl.exp is the hardware's ex2.approx of x log2(e): a few ulps plus the
# argument's rounding times |x| log2(e), up to ~30 fp32 eps at |g| ~ 100 (the
# interpreter's is numpy's, within an ulp); GELU's tail bound grows alike.
FP32_EPS_UNITS = 4.0 if interpret_mode() else 64.0
GELU_TAIL = 2.0**-22 if interpret_mode() else 2.0**-17


def _check(gate_up: torch.Tensor, gelu: bool, what: str, max_off: float | None = None) -> float:
    from kernels.fused_activation import act_mul

    out = act_mul(gate_up, gelu)
    ref = reference.act_mul(gate_up, gelu)
    dtype = gate_up.dtype
    gate = gate_up[..., : gate_up.shape[-1] // 2].float()
    up = gate_up[..., gate_up.shape[-1] // 2 :].float()
    # GELU's tail: torch's 1 + tanh(u) is a multiple of 2^-24, so off by ~2^-24 |g up|
    atol = float((gate * up).abs().max()) * GELU_TAIL if gelu else 0.0
    if max_off is None:
        max_off = 1.0 if dtype == torch.float32 else MAX_OFF[gelu]
    return compare(out, ref, what, atol=atol, max_off=max_off,
                   eps_units=FP32_EPS_UNITS if dtype == torch.float32 else 2.0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("intermediate", [200, 1500])
def test_act_mul(dtype: torch.dtype, gelu: bool, intermediate: int) -> None:
    skip_unless_runnable()
    gen = torch.Generator().manual_seed(intermediate + gelu)
    wide = (3 * torch.randn(5, 2 * intermediate + 9, generator=gen)).to(device(), dtype)
    _check(wide[:, : 2 * intermediate], gelu, f"act_mul {dtype} gelu={gelu} I={intermediate}")


@pytest.mark.parametrize("gelu", [False, True])
def test_act_mul_3d_and_empty(gelu: bool) -> None:
    skip_unless_runnable()
    from kernels.fused_activation import act_mul

    gen = torch.Generator().manual_seed(1)
    _check(torch.randn(2, 3, 64, generator=gen).to(device()), gelu, "3-D")
    assert act_mul(torch.empty(0, 64, device=device()), gelu).shape == (0, 32)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy's inf / NaN notes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu", [False, True])
def test_act_mul_special_values(dtype: torch.dtype, gelu: bool) -> None:
    skip_unless_runnable()
    gate = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 1e30, -1e30,
                         88.0, -88.0, 100.0, -100.0, 1e-30, -1e-30, 3.0, -3.0, -12.0])
    up = torch.tensor([1.5, 1.5, 1.5, 2.0, 2.0, 1.0, 1.0, -1.0, -1.0, 0.5, 0.5, 1.0, 1.0,
                       float("inf"), 0.0, -2.0])
    gate_up = torch.cat([gate, up])[None].to(device(), dtype)
    # all bit-identical in the interpreter; one may sit at a bf16 tie with CUDA's exp
    _check(gate_up, gelu, f"special values {dtype} gelu={gelu}",
           max_off=None if dtype == torch.float32 else 1 / 16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gelu", [False, True])
def test_mlp_triton_path_equals_its_torch_path(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, gelu: bool
) -> None:
    skip_unless_runnable()
    from kernels import fused_activation
    from services.worker.models import llama
    from services.worker.models.llama import LlamaMLP

    asked = force_triton_path(monkeypatch, llama)
    launched = spy(monkeypatch, fused_activation, "act_mul")
    config = mlp_config("gelu_pytorch_tanh" if gelu else "silu")
    dev = device()
    fused, plain = LlamaMLP(config, fused=True), LlamaMLP(config, fused=False)
    gen = torch.Generator().manual_seed(2)
    for name in ("gate_up_weight", "down_weight"):
        weight = (torch.randn(getattr(fused, name).shape, generator=gen) * 0.3).to(dev, dtype)
        getattr(fused, name).data = weight
        getattr(plain, name).data = weight.clone()
    x = torch.randn(6, 48, generator=gen).to(dev, dtype)
    out, ref = fused(x), plain(x)
    assert len(launched) == 1 and set(asked) == {(x.device, dtype)}
    # the activations are equal up to the rounding above; through the down projection
    # one ulp of an activation moves an output by about eps times its row's scale
    scale = float(ref.float().abs().max())
    torch.testing.assert_close(out.float(), ref.float(), rtol=0, atol=8 * EPS[dtype] * scale)
