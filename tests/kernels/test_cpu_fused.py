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

SiLU is also compared bit for bit with its own arithmetic spelled out in torch ops
(``_silu_mul_exact``: the Cephes exp of cpu_scalar.h, each op rounded to fp32), over
every bf16 gate value (the bf16 kernel reads a table of them), odd widths (vector
tails) and the special values. ``write_kv_cache`` is an exact copy: equal to
``reference.write_kv_cache``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_fused, reference
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
    scaling = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 256,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0}  # HF requires all four
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


def _silu_mul_exact(gate_up: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic, op for op in fp32 (torch rounds each op; no FMA)."""
    gate, up = (h.float() for h in gate_up.chunk(2, dim=-1))

    def c(v: float) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.float32)

    x = -gate
    # std::min(std::max(x, -87), 88), which keeps a NaN
    xc = torch.where(x < -87.0, c(-87.0), x)
    xc = torch.where(xc > 88.0, c(88.0), xc)
    magic = c(12582912.0)
    n = (xc * c(1.44269504088896341) + magic) - magic
    r = (xc - n * c(0.693359375)) + n * c(2.12194440e-4)
    p = c(1.9875691500e-4)
    for k in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
              5.0000001201e-1):
        p = p * r + c(k)
    p = ((p * r) * r + r) + c(1.0)
    two_n = ((torch.nan_to_num(n).int() + 127) << 23).view(torch.float32)
    e = torch.where(x > 88.72283, c(float("inf")), torch.where(x < -87.33655, c(0.0), p * two_n))
    silu = (gate / (c(1.0) + e)).to(gate_up.dtype).float()
    return (silu * up).to(gate_up.dtype)


def assert_bits_equal(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Equal bits, except that any NaN matches any NaN (NaN payloads are not specified)."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, f"{what}: {got.dtype} {got.shape}"
    int_type = torch.int32 if got.dtype == torch.float32 else torch.int16
    nan = got.isnan()
    assert torch.equal(nan, ref.isnan()), f"{what}: NaN in other places"
    same = got.view(int_type) == ref.view(int_type)
    bad = ~(same | nan)
    assert not bad.any(), f"{what}: {int(bad.sum())} elements differ, first at {bad.nonzero()[0].tolist()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 35, 2048])
@pytest.mark.parametrize("intermediate", [37, 1536])
def test_silu_mul_bits(dtype: torch.dtype, num_tokens: int, intermediate: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens * intermediate)
    gate_up = (4 * torch.randn(num_tokens, 2 * intermediate, generator=gen)).to(dtype)
    got = cpu_fused.silu_mul(gate_up)
    assert_bits_equal(got, _silu_mul_exact(gate_up), f"silu_mul T={num_tokens} I={intermediate}")
    if num_tokens > 1:  # a row stride other than 2 * I: a slice of a wider tensor
        assert_bits_equal(cpu_fused.silu_mul(gate_up[::2]), got[::2], "strided rows")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_every_bf16_gate(dtype: torch.dtype) -> None:
    """Every bf16 value (so every entry of the bf16 kernel's table), times three ups."""
    gates = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for up in (1.0, -0.3, 3.0e38):
        gate_up = torch.cat([gates, torch.full_like(gates, up)]).view(1, -1).to(dtype)
        assert_bits_equal(cpu_fused.silu_mul(gate_up), _silu_mul_exact(gate_up), f"up={up}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_special_values_bits(dtype: torch.dtype) -> None:
    tiny = torch.finfo(torch.float32).tiny
    gate = torch.tensor([-200.0, -89.0, -88.72, -87.5, -87.33, -20.0, -0.0, 0.0, 1e-30, tiny / 3,
                         -tiny / 3, 20.0, 87.33, 88.0, 88.73, 89.0, 1e30, -1e30, 3.0e38, -3.0e38,
                         float("inf"), float("-inf"), float("nan"), -float("nan")])
    ups = torch.tensor([1.5, -2.0, 0.0, float("inf"), float("nan"), 1e-30, 1e38])
    gate_up = torch.cat([gate.repeat(len(ups)), ups.repeat_interleave(len(gate))])
    gate_up = gate_up.view(1, -1).to(dtype)  # 168 lanes: ten full vectors and a tail
    assert_bits_equal(cpu_fused.silu_mul(gate_up), _silu_mul_exact(gate_up), "special values")


def _kv_inputs(
    num_tokens: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, num_blocks: int,
    block_size: int, gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v as llama.py slices them out of qkv; random caches; distinct slots, some -1."""
    q_size, kv_size = 2 * num_kv_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(dtype)
    _, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.rand(num_tokens, generator=gen) < 0.2] = -1
    return k, v, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 35, 1500])  # 1500: several threads
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (1, 128), (2, 40)])
def test_write_kv_cache(dtype: torch.dtype, num_tokens: int, num_kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens + head_dim)
    k, v, k_cache, v_cache, slots = _kv_inputs(num_tokens, num_kv_heads, head_dim, dtype, 200, 16, gen)
    assert num_tokens == 1 or not k.is_contiguous()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(k, v, k_ref, v_ref, slots)
    k_ptr = k_cache.data_ptr()
    cpu_fused.write_kv_cache(k, v, k_cache, v_cache, slots)
    assert k_cache.data_ptr() == k_ptr
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_write_kv_cache_other_layouts() -> None:
    """Contiguous key / value, a value with heads transposed (copied first), all slots -1,
    no tokens."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)
    k = torch.randn(5, 2, 16, generator=gen)
    v = torch.randn(2, 5, 16, generator=gen).transpose(0, 1)
    slots = torch.tensor([31, 0, -1, 9, 8])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(k, v, k_ref, v_ref, slots)
    cpu_fused.write_kv_cache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    cpu_fused.write_kv_cache(k, v, k_cache, v_cache, torch.full((5,), -1))
    cpu_fused.write_kv_cache(k[:0], v[:0], k_cache, v_cache, slots[:0])
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_write_kv_cache_rounds_fp32_rows_into_bf16_caches(num_tokens: int) -> None:
    """An fp32 model's bf16 KV cache: each row rounded to nearest even as torch's
    ``.to(torch.bfloat16)`` (the reference's write), the special values included."""
    gen = torch.Generator().manual_seed(num_tokens)
    k, v, k_cache, v_cache, slots = _kv_inputs(num_tokens, 3, 64, torch.float32, 200, 16, gen)
    k[0, 0, :5] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1 + 2**-8, 3e38])
    k_cache, v_cache = k_cache.bfloat16(), v_cache.bfloat16()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv_cache(k, v, k_ref, v_ref, slots)
    cpu_fused.write_kv_cache(k, v, k_cache, v_cache, slots)
    # exact, NaN where NaN (torch's own NaN bits differ between its conversion paths)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("key_dtype,cache_dtype", [(torch.bfloat16, torch.float32),
                                                   (torch.float32, torch.float16)])
def test_write_kv_cache_refuses_other_dtype_pairs(key_dtype: torch.dtype,
                                                  cache_dtype: torch.dtype) -> None:
    k_cache = v_cache = torch.zeros(4, 16, 2, 8, dtype=cache_dtype)
    k = v = torch.ones(3, 2, 8, dtype=key_dtype)
    with pytest.raises(ValueError, match="dtype"):
        cpu_fused.write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, 1, 5]))


@pytest.mark.parametrize("bad_slot", [-2, 64, 2**40])
def test_write_kv_cache_bad_slot_writes_nothing(bad_slot: int) -> None:
    k_cache, v_cache = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    k = v = torch.ones(3, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping"):
        cpu_fused.write_kv_cache(k, v, k_cache, v_cache, torch.tensor([0, bad_slot, 5]))
    assert not k_cache.any() and not v_cache.any()


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
        *_bad_kv_inputs(),
    ]


def _bad_kv_inputs() -> list[tuple[str, object, tuple]]:
    k, cache, slots = torch.randn(3, 2, 8), torch.zeros(4, 16, 2, 8), torch.tensor([0, 1, 2])
    fn = cpu_fused.write_kv_cache
    return [
        ("kv key dtype", fn, (k.bfloat16(), k.bfloat16(), cache, cache, slots)),
        ("kv value dtype", fn, (k, k.bfloat16(), cache, cache, slots)),
        ("kv v_cache dtype", fn, (k, k, cache, cache.bfloat16(), slots)),
        ("kv fp16", fn, (k.half(), k.half(), cache.half(), cache.half(), slots)),
        ("kv value shape", fn, (k, k[:, :1], cache, cache, slots)),
        ("kv key ndim", fn, (k[0], k[0], cache, cache, slots)),
        ("kv head_dim", fn, (k[..., :4], k[..., :4], cache, cache, slots)),
        ("kv heads", fn, (k, k, cache[:, :, :1], cache[:, :, :1], slots)),
        ("kv v_cache shape", fn, (k, k, cache, cache[:2], slots)),
        ("kv cache ndim", fn, (k, k, cache[0], cache[0], slots)),
        ("kv cache not contiguous", fn, (k, k, cache.transpose(0, 1), cache.transpose(0, 1), slots)),
        ("kv slots length", fn, (k, k, cache, cache, slots[:2])),
        ("kv slots int32", fn, (k, k, cache, cache, slots.int())),
        ("kv slots 2-d", fn, (k, k, cache, cache, slots[None])),
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
    _, residual = RMSNorm(64, 1e-6)(x, x)  # fused=True, but the torch path runs
    assert torch.equal(residual, x + x)


# -- argmax_rows ---------------------------------------------------------------------------
def _argmax_cases() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    special = torch.randn(7, 50, generator=gen)
    special[0, 3] = special[0, 7] = float("nan")  # the first NaN wins
    special[1] = float("-inf")  # every value -inf: index 0
    special[2] = 1.0  # all ties: index 0
    special[3, 10] = special[3, 20] = float("inf")  # the first of two +inf
    special[4] = float("nan")
    special[5, -1] = 1e30  # the largest is last
    special[6, 0] = -0.0
    return [
        ("vocab-sized", torch.randn(36, 49152, generator=gen)),
        ("one column", torch.randn(5, 1, generator=gen)),
        ("one row, odd width", torch.randn(1, 37, generator=gen)),
        ("special values", special),
        ("row-strided", torch.randn(9, 64, generator=gen)[:, :41]),
        ("duplicated maxima", torch.randint(0, 3, (20, 300), generator=gen).float()),
    ]


@pytest.mark.parametrize("case", _argmax_cases(), ids=lambda c: c[0])
def test_argmax_rows_matches_torch(case: tuple[str, torch.Tensor]) -> None:
    x = case[1]
    assert torch.equal(cpu_fused.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("case", _argmax_cases(), ids=lambda c: c[0])
def test_argmax_rows_of_bf16_is_the_argmax_of_its_fp32_copy(case: tuple[str, torch.Tensor]) -> None:
    """A greedy step's bf16 logits go to the kernel as they are: the same index as the
    fp32 copy it used to make (rounding to bf16 makes many more ties: the first wins)."""
    x = case[1].bfloat16()
    assert torch.equal(cpu_fused.argmax_rows(x), x.float().argmax(dim=-1))


@pytest.mark.parametrize("bad", [torch.zeros(3, 4).half(), torch.zeros(3), torch.zeros(3, 0),
                                 torch.zeros(4, 3).t()], ids=["fp16", "1-D", "empty", "transposed"])
def test_argmax_rows_rejects(bad: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        cpu_fused.argmax_rows(bad)


@pytest.mark.slow
def test_portable_build_scans_alike() -> None:
    """The row scans' portable loops (machines without AVX-512 BW/VL) against torch and the
    native build: argmax_rows on every case in both dtypes, screen_columns column for
    column (the same fp32 threshold, compared lane by lane or one by one)."""
    namespace = "pagoda_cpu_fused_portable"
    cpu_fused.build_library(namespace, defines=("PAGODA_PORTABLE",))
    ops = getattr(torch.ops, namespace)
    for name, x in _argmax_cases():
        for dtype in DTYPES:
            xd = x.to(dtype)
            assert torch.equal(ops.argmax_rows(xd), xd.float().argmax(dim=-1)), (name, dtype)
    for name, x, bounds, rel in _screen_cases():
        for dtype in DTYPES:
            xd = x.to(dtype)
            assert torch.equal(ops.screen_columns(xd, bounds, rel),
                               cpu_fused.screen_columns(xd, bounds, rel)), (name, dtype)


# -- screen_columns ------------------------------------------------------------------------
def _screen_reference(x: torch.Tensor, bounds: torch.Tensor, rel: float) -> torch.Tensor:
    """The rule in float64, column by column: keep v if s_v + b + rel |s_v| reaches
    m - b - rel |m| for some row (m its top score); a NaN row keeps everything."""
    s = x.double()
    keep = torch.zeros(x.shape[1], dtype=torch.bool)
    for r in range(x.shape[0]):
        row, b = s[r], float(bounds[r])
        if torch.isnan(row).any():
            keep[:] = True
            continue
        m = float(row.max())
        keep |= row + b + rel * row.abs() >= m - b - rel * abs(m)
    return keep.nonzero().view(-1)


def _screen_cases() -> list[tuple[str, torch.Tensor, torch.Tensor, float]]:
    gen = torch.Generator().manual_seed(11)
    def rand(*shape: int, scale: float = 3.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale
    negative = -rand(4, 500).abs() - 5.0  # every score below zero: the other branch
    nan_row = rand(3, 200)
    nan_row[1, 50] = float("nan")
    ties = torch.randint(0, 4, (6, 333), generator=gen).float()
    return [
        ("vocab-sized", rand(45, 49152), torch.rand(45, generator=gen, dtype=torch.float64) * 2, 2.0**-8),
        ("one row", rand(1, 4099), torch.tensor([0.7], dtype=torch.float64), 2.0**-8),
        ("exact (no error)", rand(5, 300), torch.zeros(5, dtype=torch.float64), 0.0),
        ("all negative", negative, torch.full((4,), 0.3, dtype=torch.float64), 0.01),
        ("NaN row keeps all", nan_row, torch.full((3,), 0.1, dtype=torch.float64), 2.0**-8),
        ("ties", ties, torch.zeros(6, dtype=torch.float64), 0.0),
        ("wide bounds", rand(3, 100), torch.full((3,), 1e6, dtype=torch.float64), 2.0**-8),
        ("row-strided", rand(7, 130)[:, :97], torch.full((7,), 0.5, dtype=torch.float64), 2.0**-8),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", _screen_cases(), ids=lambda c: c[0])
def test_screen_columns_matches_the_rule_in_float64(
    case: tuple[str, torch.Tensor, torch.Tensor, float], dtype: torch.dtype
) -> None:
    _, x, bounds, rel = case
    x = x.to(dtype)
    got = cpu_fused.screen_columns(x, bounds, rel)
    want = _screen_reference(x, bounds, rel)
    # the kernel rounds its threshold down to fp32: it may keep a column the float64 rule
    # drops by a rounding, never drop one it keeps
    assert set(want.tolist()) <= set(got.tolist())
    assert got.numel() - want.numel() <= 2
    assert torch.equal(got, got.sort().values) and got.unique().numel() == got.numel()


def test_screen_columns_keeps_every_row_argmax() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 49152, generator=gen) * 4
    got = set(cpu_fused.screen_columns(x, torch.zeros(64, dtype=torch.float64), 0.0).tolist())
    assert set(x.argmax(dim=-1).tolist()) <= got
    assert len(got) <= 64  # no error allowed: the top column of each row only


@pytest.mark.parametrize("bounds, rel", [
    (torch.zeros(3), 0.0),  # float32 bounds
    (torch.zeros(2, dtype=torch.float64), 0.0),  # wrong length
    (torch.tensor([0.0, -1.0, 0.0], dtype=torch.float64), 0.0),  # negative
    (torch.tensor([0.0, float("inf"), 0.0], dtype=torch.float64), 0.0),  # not finite
    (torch.zeros(3, dtype=torch.float64), 1.0),  # rel out of range
], ids=["fp32 bounds", "length", "negative", "inf", "rel"])
def test_screen_columns_rejects(bounds: torch.Tensor, rel: float) -> None:
    with pytest.raises(ValueError):
        cpu_fused.screen_columns(torch.zeros(3, 10), bounds, rel)
