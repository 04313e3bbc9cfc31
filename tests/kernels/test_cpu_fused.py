"""The fused C++ CPU kernels (kernels.cpu_fused) against the torch code they replace.

Each kernel is compared with its module's torch path, called explicitly (``fused=False``
modules, ``F.silu(gate) * up``), over fp32 and bf16, T in {1, 7, 300} (300 runs on
several threads), hidden 64 / 576, head_dim 32 / 64 / 128, GQA head counts, q / k as
the strided views llama.py slices out of the qkv projection, shuffled positions.

Tolerances: the kernels round where torch rounds, so the residual sum and the rotary
outputs must be bit-identical. The RMSNorm sum of squares (another summation order)
and the exp inside SiLU (Cephes vs Sleef) differ by a few fp32 ulps: fp32 outputs
within 2e-6 relative. In bf16 it flips the rounding of the intermediate (normalised x,
silu(gate)) only when that value sits within a few fp32 ulps of a bf16 tie; one ulp
there (up to 2^-7 relative), times the weight / up and rounded again, moves the output
by at most about 2 ulps: 2^-6 relative, allowed on at most 1 % of the elements.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_fused
from kernels.cpu_extension import LazyExtension
from services.worker.layers.norm import RMSNorm
from services.worker.layers.rotary import RotaryEmbedding

if not cpu_fused.available():
    pytest.skip("the cpu_fused extension did not build", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 7, 300]


def assert_matches(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """fp32: 2e-6 relative; bf16: 2^-6 relative on at most 1 % of elements."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, f"{what}: {got.dtype} {got.shape}"
    g, r = got.float(), ref.float()
    diff = (g - r).abs()
    if ref.dtype == torch.float32:
        bad = diff > 1e-30 + 2e-6 * r.abs()
        assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max {float(diff.max()):.3g}"
        return
    off = diff > 0
    too_far = diff > 2.0**-6 * r.abs()
    assert not too_far.any(), f"{what}: beyond 2 bf16 ulps, max {float(diff.max()):.3g}"
    assert int(off.sum()) <= max(1, off.numel() // 100), f"{what}: {int(off.sum())} elements off"


def _norm(hidden: int, dtype: torch.dtype, fused: bool, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-6, fused=fused)
    norm.weight.data = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(dtype)
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, num_tokens: int, hidden: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(num_tokens * hidden)
    x = (3 * torch.randn(num_tokens, hidden, generator=gen)).to(dtype)
    residual = torch.randn(num_tokens, hidden, generator=gen).to(dtype) if with_residual else None
    fused, plain = _norm(hidden, dtype, True, gen), _norm(hidden, dtype, False, gen)
    plain.weight.data = fused.weight.data
    out, new_residual = fused(x, residual)
    ref_out, ref_residual = plain(x, residual)
    assert torch.equal(new_residual, ref_residual), "x + residual must round as torch's add"
    if residual is None:
        assert new_residual is x
    assert_matches(out, ref_out, f"rms_norm T={num_tokens} H={hidden}")


def _qkv_views(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:  # q, k as llama.py slices them: strided rows
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    assert q.data_ptr() == qkv.data_ptr() and (num_tokens == 1 or not q.is_contiguous())
    return q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2)])
def test_rotary(
    dtype: torch.dtype, num_tokens: int, head_dim: int, num_heads: int, num_kv_heads: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    q, k = _qkv_views(num_tokens, num_heads, num_kv_heads, head_dim, dtype, gen)
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 256}
    fused = RotaryEmbedding(head_dim, 4096, 10000.0, scaling)
    plain = RotaryEmbedding(head_dim, 4096, 10000.0, scaling, fused=False)
    positions = torch.randperm(4096, generator=gen)[:num_tokens]  # out of order
    q_out, k_out = fused(positions, q, k)
    q_ref, k_ref = plain(positions, q, k)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


def test_rotary_other_layouts() -> None:
    """Contiguous inputs, int32 positions, and a transposed key (copied by the kernel)."""
    gen = torch.Generator().manual_seed(5)
    rot = RotaryEmbedding(64, 128, 10000.0, None, fused=False)
    q = torch.randn(5, 4, 64, generator=gen)
    k = torch.randn(2, 5, 64, generator=gen).transpose(0, 1)
    positions = torch.tensor([3, 0, 127, 9, 9])
    q_ref, k_ref = rot(positions, q, k)
    q_out, k_out = cpu_fused.rotary(q, k, positions.int(), rot.cos_cache, rot.sin_cache)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("intermediate", [64, 1536])
def test_silu_mul(dtype: torch.dtype, num_tokens: int, intermediate: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens + intermediate)
    gate_up = (4 * torch.randn(num_tokens, 2 * intermediate, generator=gen)).to(dtype)
    gate, up = gate_up.split(intermediate, dim=-1)
    assert_matches(cpu_fused.silu_mul(gate_up), F.silu(gate) * up, f"silu_mul T={num_tokens}")


def test_silu_mul_extremes() -> None:
    gate = torch.tensor([-200.0, -89.0, -87.5, -20.0, -0.0, 0.0, 1e-30, 20.0, 89.0, 1e30,
                         float("inf"), float("-inf")])
    gate_up = torch.cat([gate, torch.full_like(gate, 1.5)])[None]
    got, ref = cpu_fused.silu_mul(gate_up), F.silu(gate) * 1.5
    torch.testing.assert_close(got[0], ref, rtol=2e-6, atol=1e-30, equal_nan=True)
    nan = cpu_fused.silu_mul(torch.tensor([[float("nan"), 1.0]]).bfloat16())
    assert nan.isnan().all()


def test_thread_count_does_not_change_results() -> None:
    x = torch.randn(300, 576).bfloat16()
    gate_up = torch.randn(300, 3072).bfloat16()
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, max(2, threads)):
            torch.set_num_threads(n)
            outs.append((cpu_fused.rms_norm(x, x, x[0], 1e-6)[0], cpu_fused.silu_mul(gate_up)))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def _bad_inputs() -> list[tuple[str, object, tuple]]:
    x, w = torch.randn(3, 64), torch.ones(64)
    q, k = torch.randn(3, 4, 32), torch.randn(3, 2, 32)
    pos, cache = torch.tensor([0, 1, 2]), torch.randn(16, 16)
    past_end, negative = torch.tensor([0, 16, 1]), torch.tensor([0, -1, 1])
    return [
        ("norm fp16", cpu_fused.rms_norm, (x.half(), None, w.half(), 1e-6)),
        ("norm weight dtype", cpu_fused.rms_norm, (x.bfloat16(), None, w, 1e-6)),
        ("norm weight size", cpu_fused.rms_norm, (x, None, w[:32], 1e-6)),
        ("norm residual shape", cpu_fused.rms_norm, (x, x[:2], w, 1e-6)),
        ("norm residual dtype", cpu_fused.rms_norm, (x, x.bfloat16(), w, 1e-6)),
        ("rotary position too large", cpu_fused.rotary, (q, k, past_end, cache, cache)),
        ("rotary negative position", cpu_fused.rotary, (q, k, negative, cache, cache)),
        ("rotary positions length", cpu_fused.rotary, (q, k, pos[:2], cache, cache)),
        ("rotary positions dtype", cpu_fused.rotary, (q, k, pos.float(), cache, cache)),
        ("rotary key dtype", cpu_fused.rotary, (q, k.bfloat16(), pos, cache, cache)),
        ("rotary head_dim", cpu_fused.rotary, (q, k[..., :16], pos, cache, cache)),
        ("rotary odd head_dim", cpu_fused.rotary, (q[..., :31], k[..., :31], pos, cache, cache)),
        ("rotary cache width", cpu_fused.rotary, (q, k, pos, cache[:, :8], cache[:, :8])),
        ("rotary cache dtype", cpu_fused.rotary, (q, k, pos, cache.bfloat16(), cache.bfloat16())),
        ("rotary ndim", cpu_fused.rotary, (q[0], k, pos, cache, cache)),
        ("silu odd width", cpu_fused.silu_mul, (torch.randn(3, 7),)),
        ("silu ndim", cpu_fused.silu_mul, (torch.randn(6),)),
        ("silu fp64", cpu_fused.silu_mul, (torch.randn(3, 8, dtype=torch.float64),)),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
def test_bad_inputs_raise_value_error(case: tuple[str, object, tuple]) -> None:
    _, fn, args = case
    with pytest.raises(ValueError):
        fn(*args)  # type: ignore[operator]


def test_failed_build_is_reported_once_and_modules_fall_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_fused, "_extension", LazyExtension("cpu_fused kernels", cpu_fused.build_library))
    monkeypatch.setattr(cpu_fused, "_SOURCE", tmp_path / "missing.cpp")
    assert not cpu_fused.available() and not cpu_fused.available()
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="did not build"):
        cpu_fused.silu_mul(x)
    out, residual = RMSNorm(64, 1e-6)(x, x)  # fused=True, but the torch path runs
    assert torch.equal(residual, x + x)
