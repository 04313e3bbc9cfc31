"""``layers.linear``: which kernel a CPU linear runs, and that each agrees with fp32 torch.

Where ``kernels.cpu_gemm`` has the vector path for the dtype, every row count runs it
(AVX-512 tiles, or on an AVX2 machine its 256-bit tiles);
elsewhere (and with ``kernel="onednn"``) bf16 at up to GEMV_MAX_ROWS rows streams the
plain weight through ``kernels.cpu_gemv`` and the rest uses oneDNN's packed weight.
A SwiGLU MLP's gate_up is packed for ``cpu_gemm.linear_silu`` where cpu_gemm runs it.
``pack_cpu_linears`` moves the cpu_gemm weights into a ``HugePageArena``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_fused, cpu_gemm, cpu_gemv
from services.worker.cpu_memory import HugePageArena
from services.worker.layers.linear import (
    GEMV_MAX_ROWS,
    auto_kernel,
    linear,
    pack_cpu_linears,
    pack_weight,
)
from tests.support.model_configs import mlp_config


def _onednn_packs(dtype: torch.dtype) -> bool:
    """bf16 needs AVX-512 or AVX-NE-CONVERT in oneDNN: not on an AVX2 machine."""
    return pack_weight(torch.ones(8, 8, dtype=dtype), "onednn") is not None


def need_onednn(dtype: torch.dtype) -> None:
    if not _onednn_packs(dtype):
        pytest.skip(f"oneDNN cannot pack a {dtype} weight on this CPU")


onednn = pytest.mark.skipif(not _onednn_packs(torch.float32),
                            reason="oneDNN weight packing unavailable")


def _case(dtype: torch.dtype, rows: int, bias: bool, kernel: str = "auto"):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    w = (torch.randn(960, 576, generator=g) * 0.05).to(dtype)
    b = (torch.randn(960, generator=g) * 0.1).to(dtype) if bias else None
    return x, w, b, pack_weight(w, kernel)


def _close_to_fp32(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                   b: torch.Tensor | None) -> None:
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = 1e-4 if got.dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 64, 300])
def test_auto_runs_cpu_gemm_where_it_has_the_vector_path(dtype: torch.dtype, rows: int) -> None:
    if dtype not in cpu_gemm.simd_dtypes():
        pytest.skip(f"cpu_gemm has no vector path for {dtype} on this CPU")
    x, w, b, packed = _case(dtype, rows, True)
    assert packed is not None and packed.gemm and packed.out_features == 960
    got = linear(x, w, b, packed)
    assert torch.equal(got, cpu_gemm.linear(x, cpu_gemm.pack(w), 960, b))  # bit for bit
    _close_to_fp32(got, x, w, b)


@onednn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_auto_without_the_vector_path_is_onednn(dtype: torch.dtype,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # a CPU without AVX2: the build has no vector path for either dtype
    need_onednn(dtype)
    monkeypatch.setattr(cpu_gemm, "simd_dtypes", lambda: frozenset())
    x, w, b, packed = _case(dtype, 4, True)
    assert packed is not None and not packed.gemm
    _close_to_fp32(linear(x, w, b, packed), x, w, b)


@onednn
def test_auto_keeps_onednn_for_bf16_on_an_amx_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # oneDNN runs bf16 on the AMX tiles; fp32 (no AMX path) still takes cpu_gemm
    need_onednn(torch.bfloat16)
    real = torch.cpu.get_capabilities()
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {**real, "amx_bf16": True})
    x, w, b, packed = _case(torch.bfloat16, 16, True)
    assert packed is not None and not packed.gemm
    _close_to_fp32(linear(x, w, b, packed), x, w, b)
    if torch.float32 in cpu_gemm.simd_dtypes():
        _, _, _, packed32 = _case(torch.float32, 16, True)
        assert packed32 is not None and packed32.gemm
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {**real, "amx_bf16": False})
    if torch.bfloat16 in cpu_gemm.simd_dtypes():
        assert pack_weight(w).gemm  # type: ignore[union-attr]


@onednn
def test_cpu_gemm_is_chosen_wherever_it_has_vector_tiles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Any vector tiles of cpu_gemm are the choice, on AVX-512 CPUs too (bf16 without
    AVX512-BF16: its widening tiles, or the 256-bit ones in a build without AVX-512,
    measured 1.7-2.6x oneDNN's emulated bf16 on an Ice Lake class Xeon); only bf16 on
    AMX keeps oneDNN, and a dtype without tiles."""
    real = torch.cpu.get_capabilities()
    monkeypatch.setattr(torch.cpu, "get_capabilities",
                        lambda: {**real, "avx512f": True, "amx_bf16": False})
    for bf16_tiles in ("avx2", "avx512_widen", "avx512"):
        monkeypatch.setattr(cpu_gemm, "simd_dtypes",
                            lambda: frozenset({torch.float32, torch.bfloat16}))
        monkeypatch.setattr(cpu_gemm, "tile_paths",
                            lambda t=bf16_tiles: {torch.float32: "avx512", torch.bfloat16: t})
        assert auto_kernel(torch.bfloat16) == "cpu_gemm", bf16_tiles
        assert auto_kernel(torch.float32) == "cpu_gemm"
    monkeypatch.setattr(cpu_gemm, "simd_dtypes", lambda: frozenset({torch.float32}))
    assert auto_kernel(torch.bfloat16) == "onednn"


@onednn
@pytest.mark.skipif(not cpu_gemv.available(), reason="the cpu_gemv extension did not build")
@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_bf16_few_rows_run_the_gemv_kernel(rows: int, bias: bool) -> None:
    need_onednn(torch.bfloat16)
    x, w, b, packed = _case(torch.bfloat16, rows, bias, "onednn")
    assert packed is not None and not packed.gemm
    got = linear(x, w, b, packed)
    assert torch.equal(got, cpu_gemv.linear_bf16(x, w, b))  # that kernel, bit for bit
    _close_to_fp32(got, x, w, b)


@onednn
@pytest.mark.parametrize(("dtype", "rows"), [(torch.bfloat16, GEMV_MAX_ROWS + 1),
                                             (torch.bfloat16, 64), (torch.float32, 1)])
def test_onednn_more_rows_and_fp32_run_onednn(dtype: torch.dtype, rows: int) -> None:
    need_onednn(dtype)
    x, w, b, packed = _case(dtype, rows, True, "onednn")
    assert packed is not None and not packed.gemm
    got = linear(x, w, b, packed)
    assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, packed.data, b, "none", [],
                                                               ""))
    _close_to_fp32(got, x, w, b)


def test_weights_off_the_cpu_or_in_other_dtypes_are_not_packed() -> None:
    assert pack_weight(torch.ones(8, 8, dtype=torch.float16)) is None
    assert pack_weight(torch.ones(8, 8, device="meta")) is None


def test_without_a_packed_weight_it_is_f_linear() -> None:
    x, w, b, _ = _case(torch.bfloat16, 2, True)
    assert torch.equal(linear(x, w, b, None), F.linear(x, w, b))


def _mlp(hidden_act: str, mlp_bias: bool, dtype: torch.dtype):  # type: ignore[no-untyped-def]
    from services.worker.models.llama import LlamaMLP

    config = mlp_config(hidden_act, hidden_size=64, intermediate_size=100, mlp_bias=mlp_bias)
    mlp = LlamaMLP(config)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return mlp.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mlp_bias", [False, True])
def test_swiglu_mlp_packs_gate_up_for_linear_silu(dtype: torch.dtype, mlp_bias: bool) -> None:
    """Where cpu_gemm has the vector path, a SwiGLU MLP's gate_up is packed for the fused
    linear_silu, and the MLP's output is bit-equal to the unfused packed path (the linear,
    then cpu_fused.silu_mul) and close to fp32 torch."""
    if dtype not in cpu_gemm.simd_dtypes():
        pytest.skip(f"cpu_gemm has no vector path for {dtype} on this CPU")
    mlp = _mlp("silu", mlp_bias, dtype)
    x = torch.randn(13, 64, generator=torch.Generator().manual_seed(4)).to(dtype)
    plain = mlp(x)  # not packed: F.linear and silu_mul
    assert pack_cpu_linears(mlp) == 2
    assert mlp.gate_up_weight_packed.silu_gated and not mlp.down_weight_packed.silu_gated
    got = mlp(x)
    unfused = pack_weight(mlp.gate_up_weight)  # the same kernel, not gated
    gate_up = linear(x, mlp.gate_up_weight, mlp.gate_up_bias, unfused)
    want = linear(cpu_fused.silu_mul(gate_up), mlp.down_weight, mlp.down_bias,
                  mlp.down_weight_packed)
    assert torch.equal(got, want)
    torch.testing.assert_close(got.float(), plain.float(), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="linear_silu"):  # not a plain linear's weight
        linear(x, mlp.gate_up_weight, None, mlp.gate_up_weight_packed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_gemm_weights_are_packed_into_the_arena(dtype: torch.dtype) -> None:
    """The arena's copies are the packs themselves: the MLP gives the same bits as with
    weights packed outside it."""
    if auto_kernel(dtype) != "cpu_gemm":
        pytest.skip(f"{dtype} linears do not run cpu_gemm on this CPU")
    mlp = _mlp("silu", True, dtype)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(5)).to(dtype)
    arena = HugePageArena()
    assert pack_cpu_linears(mlp, arena=arena) == 2
    for packed in (mlp.gate_up_weight_packed, mlp.down_weight_packed):
        assert packed.gemm and arena.holds(packed.data)
    got = mlp(x)
    mlp.gate_up_weight_packed = pack_weight(mlp.gate_up_weight, silu_gated=True)
    mlp.down_weight_packed = pack_weight(mlp.down_weight)
    assert not arena.holds(mlp.down_weight_packed.data)
    assert torch.equal(got, mlp(x))


def test_geglu_mlp_gate_up_is_packed_plain() -> None:
    mlp = _mlp("gelu_pytorch_tanh", False, torch.float32)
    pack_cpu_linears(mlp)
    assert mlp.gate_up_weight_packed is None or not mlp.gate_up_weight_packed.silu_gated
