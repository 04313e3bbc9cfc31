"""The packed-weight GEMM (kernels.cpu_gemm), bf16 and fp32, against torch in fp32.

Oracle: ``F.linear(x.float(), W.float(), b.float())`` rounded to the dtype.

bf16: the kernel sums the same exact bf16 products in fp32 (in another order) and rounds
once, so every output must be within 1e-2 relative of the oracle (a bf16 ulp is
2^-8..2^-7 relative), plus a few fp32 ulps of the sum of |products| for outputs that
cancel to near zero; and at least 99 % of the outputs (all but one of a small output)
must be bit-equal to it (``bf16_ulps`` == 0): the two fp32 sums differ by a few fp32 ulps,
which changes the bf16 rounding only within that distance of a tie (~1e-4 of random
outputs), while an error of half a bf16 ulp would change about half of them.

fp32: both are fp32 sums of K products and the bias in some order, and any order of a
sum of n terms is within (n - 1) u of the sum of their magnitudes from the exact one
(u = eps / 2 = 2^-24, the product roundings included: gamma_n of a dot product), so
the two are within (K + 1) * eps * sum|products and bias| of each other. Loose (the
differences seen stay under 2 eps * sum|products|), yet below the ~1/K of that sum a
lost or repeated product of average size would add: 4x below at K = 1536, 25x at 576.

Cases, for each dtype, with the native build (the tiles ``tile_paths()`` names: AVX-512,
AVX-512 widening bf16, AVX2 or portable loops), the AVX2 tiles forced with
PAGODA_NO_AVX512, the widening bf16 AVX-512 tiles forced with -mno-avx512bf16 on an
AVX512-BF16 CPU, and the portable loops forced with PAGODA_PORTABLE (slow: a compile each;
skipped for a dtype the native build already runs so): the five linears
of SmolLM2-135M at M = 1, 8, 9, 17, 64 (the lm_head at 1 and 9), odd shapes (N around
the 48-column panel and 16-lane vector edges, N < 16, K odd (bf16 pads the last pair),
K = 1, M around the 8-row tile and over several 256-row blocks), K = 0, M = 0, N = 0,
with and without bias; x rows a slice of a wider tensor, x transposed; results
independent of the thread count; ``pack``'s layout element by element (interleaved, or
split into runs of 16 columns where the AVX2 tiles run); ValueError for
inputs the op does not take; a failed build reported once. NaN / inf are not checked.

The gated pair (``pack_gated`` / ``linear_silu``, a SwiGLU MLP's gate_up and SiLU in one
call) is held to the unfused path bit for bit: this build's ``linear`` over the whole
gate_up weight, then ``cpu_fused.silu_mul``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kernel_cases import cpu_flags
from kernels import cpu_fused, cpu_gemm
from kernels.cpu_extension import LazyExtension
from tests.support.linear_oracle import assert_linear_matches

if not cpu_gemm.available():
    pytest.skip("the cpu_gemm extension did not build", allow_module_level=True)

PORTABLE_NAMESPACE = "pagoda_cpu_gemm_portable"
AVX2_NAMESPACE = "pagoda_cpu_gemm_avx2"
WIDEN_NAMESPACE = "pagoda_cpu_gemm_avx512_widen"
AVX512 = {"avx512f", "avx512bw", "avx512vl"}
PANEL = 48  # output columns per packed panel (the layout's kNR)
RUN = 16  # columns of a run of a split panel (kRunCols)
# SmolLM2-135M: qkv, o, gate_up, down, lm_head as (N, K)
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
MODEL_ROWS = (1, 8, 9, 17, 64)  # one tile, a full tile, tile + 1, several tiles
LM_HEAD_ROWS = (1, 9)  # the lm_head is 12x the next shape: its reference takes a while
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
_WEIGHTS: dict[tuple[str, int, int, torch.dtype], tuple[torch.Tensor, torch.Tensor,
                                                        torch.Tensor]] = {}


Linear = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class Build:
    """One build of the op library: its pack and linear, and the gated pair."""
    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]
    linear: Linear
    pack_gated: Callable[[torch.Tensor], torch.Tensor]
    linear_silu: Linear


NATIVE = Build("native", cpu_gemm.pack, cpu_gemm.linear, cpu_gemm.pack_gated,
               cpu_gemm.linear_silu)


def _variant(name: str, namespace: str, define: str | None = None,
             cflags: tuple[str, ...] = ()) -> Build:
    cpu_gemm.build_library(namespace, defines=(define,) if define else (), cflags=cflags)
    ops = getattr(torch.ops, namespace)
    return Build(name, ops.pack, ops.linear, ops.pack_gated, ops.linear_silu)


def _portable() -> Build:
    return _variant("portable", PORTABLE_NAMESPACE, "PAGODA_PORTABLE")


def _avx2() -> Build:
    """The 256-bit tiles, built on an AVX-512 machine too (for both dtypes)."""
    return _variant("avx2", AVX2_NAMESPACE, "PAGODA_NO_AVX512")


def _avx512_widen() -> Build:
    """The AVX-512 tiles widening bf16 (as on a CPU without AVX512-BF16), built on an
    AVX512-BF16 machine; its fp32 tiles are the native ones."""
    return _variant("avx512_widen", WIDEN_NAMESPACE, cflags=("-mno-avx512bf16",))


@pytest.fixture(
    scope="module",
    params=["native", pytest.param("avx2", marks=pytest.mark.slow),
            pytest.param("avx512_widen", marks=pytest.mark.slow),
            pytest.param("portable", marks=pytest.mark.slow)],
)
def build(request: pytest.FixtureRequest) -> Build:
    if request.param != "native" and set(cpu_gemm.tile_paths().values()) == {request.param}:
        pytest.skip(f"the native build runs the {request.param} tiles (its cases ran them)")
    if request.param == "avx2":
        if not {"avx2", "fma"} <= cpu_flags():
            pytest.skip("the CPU has no AVX2 + FMA")
        return _avx2()
    if request.param == "avx512_widen":
        if not AVX512 <= cpu_flags():
            pytest.skip("the CPU has no AVX-512")
        if cpu_gemm.tile_paths()[torch.bfloat16] == "avx512_widen":
            pytest.skip("the native build runs the avx512_widen tiles (its cases ran them)")
        return _avx512_widen()
    return NATIVE if request.param == "native" else _portable()


@pytest.fixture(params=DTYPES)
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture
def gemm(build: Build, dtype: torch.dtype) -> Build:
    """The build under test for this dtype; a variant only where the native build runs
    other tiles for it (else the native cases already ran them)."""
    if build.name != "native" and cpu_gemm.tile_paths()[dtype] == build.name:
        pytest.skip(f"the native build already runs the {build.name} tiles for {dtype}")
    if build.name == "avx512_widen" and dtype != torch.bfloat16:
        pytest.skip("the avx512_widen variant differs from the native build in bf16 only")
    return build


@pytest.fixture(scope="module", autouse=True)
def _drop_weights() -> Iterator[None]:
    yield
    _WEIGHTS.clear()  # ~450 MB with the lm_head's: not for the rest of the session


def _weights(gemm: Build, n: int, k: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Model-like W [N, K], bias [N] and W packed by this build, made once per shape (the
    lm_head's take a while)."""
    key = (gemm.name, n, k, dtype)
    if key not in _WEIGHTS:
        gen = torch.Generator().manual_seed(n * 7919 + k)
        w = (torch.randn(n, k, generator=gen) * 0.05).to(dtype)
        b = (torch.randn(n, generator=gen) * 0.1).to(dtype)
        _WEIGHTS[key] = w, b, gemm.pack(w)
    return _WEIGHTS[key]


def _x(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,k", MODEL_SHAPES)
def test_model_shapes(gemm: Build, dtype: torch.dtype, n: int, k: int,
                      with_bias: bool) -> None:
    w, b, packed = _weights(gemm, n, k, dtype)
    bias = b if with_bias else None
    for m in LM_HEAD_ROWS if n == 49152 else MODEL_ROWS:
        x = _x(m, k, dtype, seed=m)
        assert_linear_matches(gemm.linear(x, packed, n, bias), x, w, bias,
                       f"[{n} x {k}] M={m} bias={with_bias}")


ODD_SHAPES = [  # (M, N, K)
    *[(m, n, k) for m in (1, 3, 9) for n in (1, 15, 47, 49, 100) for k in (1, 33, 64)],
    (2, 16, 2), (5, 17, 31), (7, 31, 63), (8, 32, 575), (10, 33, 7),  # 16-lane edges
    (4, 48, 3), (6, 95, 5), (8, 96, 1535), (16, 97, 17), (11, 145, 576),  # panel edges
    (256, 100, 64), (257, 49, 33), (300, 100, 576), (513, 1000, 577),  # 256-row blocks
    (513, 3072, 576),
]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m,n,k", ODD_SHAPES)
def test_odd_shapes(gemm: Build, dtype: torch.dtype, m: int, n: int, k: int,
                    with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    assert_linear_matches(gemm.linear(x, gemm.pack(w), n, bias), x, w, bias,
                   f"M={m} N={n} K={k} bias={with_bias}")


def test_k0_m0_n0(gemm: Build, dtype: torch.dtype) -> None:
    bias = torch.randn(5).to(dtype)
    packed = gemm.pack(torch.empty(5, 0, dtype=dtype))
    x = torch.empty(2, 0, dtype=dtype)
    assert torch.equal(gemm.linear(x, packed, 5, bias), bias.expand(2, 5))  # the bias alone
    assert torch.equal(gemm.linear(x, packed, 5, None), torch.zeros(2, 5, dtype=dtype))
    w = torch.randn(5, 8).to(dtype)
    out = gemm.linear(torch.empty(0, 8, dtype=dtype), gemm.pack(w), 5, bias)
    assert out.shape == (0, 5) and out.dtype == dtype
    out = gemm.linear(_x(3, 8, dtype), gemm.pack(w[:0]), 0, None)
    assert out.shape == (3, 0) and out.dtype == dtype


def test_strided_x(gemm: Build, dtype: torch.dtype) -> None:
    w, b, packed = _weights(gemm, 576, 576, dtype)
    wide = _x(4, 700, dtype)
    x = wide[:, 50:626]  # rows 700 apart, as a slice of a fused projection
    assert x.stride() == (700, 1)
    assert_linear_matches(gemm.linear(x, packed, 576, b), x, w, b, "row stride 700")
    x = wide[:, 1:577]  # an odd start: the bf16 pairs are not 4-byte aligned
    assert_linear_matches(gemm.linear(x, packed, 576, b), x, w, b, "row stride 700, offset 1")
    x = _x(1, 576, dtype).expand(3, 576)  # row stride 0: the same row three times
    assert_linear_matches(gemm.linear(x, packed, 576, b), x, w, b, "row stride 0")
    xt = _x(576, 3, dtype).t()  # stride (1, 3): copied first
    assert_linear_matches(gemm.linear(xt, packed, 576, b), xt, w, b, "transposed x")
    w_odd = torch.randn(100, 33).to(dtype)
    xt = _x(33, 9, dtype).t()  # transposed with an odd K
    assert_linear_matches(gemm.linear(xt, gemm.pack(w_odd), 100, None), xt, w_odd, None,
                   "transposed x, K = 33")


def test_strided_weight_and_bias(gemm: Build, dtype: torch.dtype) -> None:
    w = torch.randn(200, 64).to(dtype)
    wt = torch.randn(64, 100).to(dtype).t()  # pack copies any layout
    assert torch.equal(gemm.pack(wt), gemm.pack(wt.contiguous()))
    b = torch.randn(200).to(dtype)[::2]  # a strided bias
    x = _x(5, 64, dtype)
    assert_linear_matches(gemm.linear(x, gemm.pack(w[::2]), 100, b), x, w[::2], b, "strided bias")


@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count_does_not_change_results(dtype: torch.dtype) -> None:
    """Threads split the panel groups: however many (more than the cores, 3 and 5, too),
    every group of every 256-row block (513 rows: three) runs once, with the same sums."""
    _, b, packed = _weights(NATIVE, 3072, 576, dtype)
    w_gated = torch.randn(2 * 1536, 576).to(dtype)
    gated = cpu_gemm.pack_gated(w_gated)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, max(2, threads), 3, 5):
            torch.set_num_threads(t)
            outs.append([cpu_gemm.linear(_x(m, 576, dtype), packed, 3072, b)
                         for m in (1, 8, 17, 300, 513)]
                        + [cpu_gemm.linear_silu(_x(m, 576, dtype), gated, 1536, None)
                           for m in (64, 513)])
    finally:
        torch.set_num_threads(threads)
    for other in outs[1:]:
        assert all(torch.equal(a, c) for a, c in zip(outs[0], other, strict=True))


def test_a_row_gets_the_same_bits_whatever_rows_come_with_it(gemm: Build,
                                                              dtype: torch.dtype) -> None:
    """Each output lane sums its products in K order whatever tile runs it (a 1-row tile,
    an 8-row one, a remainder; the AVX2 bf16 panels widened once per block from 32 rows or
    in the tiles below): 300 rows at once equal the same rows in pieces of 1 to 132, bit
    for bit, in linear and linear_silu."""
    _, b, packed = _weights(gemm, 960, 576, dtype)
    gated_w = (torch.randn(2 * 96, 576, generator=torch.Generator().manual_seed(5)) * 0.05).to(dtype)
    gated = gemm.pack_gated(gated_w)
    x = _x(300, 576, dtype, seed=3)
    pieces = [(0, 1), (1, 8), (8, 68), (68, 168), (168, 300)]
    whole = gemm.linear(x, packed, 960, b)
    assert torch.equal(whole, torch.cat([gemm.linear(x[i:j], packed, 960, b) for i, j in pieces]))
    whole = gemm.linear_silu(x, gated, 96, None)
    assert torch.equal(whole, torch.cat([gemm.linear_silu(x[i:j], gated, 96, None)
                                         for i, j in pieces]))


def test_a_column_gets_the_same_bits_whatever_columns_are_packed_beside_it(
        gemm: Build, dtype: torch.dtype) -> None:
    """Each output lane sums its column's products in K order whatever panel and position
    it has: any subset of W's rows packed alone gives those columns of the whole product,
    bit for bit (the screened greedy head, services/worker/layers/screened_argmax.py,
    recomputes its kept columns this way)."""
    w, _, packed = _weights(gemm, 960, 576, dtype)
    gen = torch.Generator().manual_seed(9)
    for rows in (1, 7, 45):
        x = _x(rows, 576, dtype, seed=rows)
        whole = gemm.linear(x, packed, 960, None)
        for size in (1, 5, 47, 48, 49, 300):
            cols = torch.randperm(960, generator=gen)[:size].sort().values
            part = gemm.linear(x, gemm.pack(w.index_select(0, cols)), size, None)
            assert torch.equal(part, whole.index_select(1, cols)), f"{rows} rows, {size} columns"


def _splits_panels(gemm: Build, dtype: torch.dtype) -> bool:
    """Whether this build packs the dtype's panels as three runs of 16 columns (the AVX2
    tiles' layout) rather than a step's 48 columns side by side."""
    tiles = gemm.name if gemm.name != "native" else cpu_gemm.tile_paths()[dtype]
    return tiles == "avx2"


@pytest.mark.parametrize("n,k", [(50, 5), (48, 4), (1, 1), (97, 2), (40, 33)])
def test_pack_layout(gemm: Build, dtype: torch.dtype, n: int, k: int) -> None:
    """Interleaved: packed[p, s, c * D + d] == W[p * 48 + c, s * D + d]; split (the AVX2
    tiles): the panel's memory is [run, s, column in run, d], runs of 16 columns; zero
    where that is past W."""
    w = torch.arange(1, n * k + 1, dtype=torch.float32).reshape(n, k).to(dtype)  # distinct
    d_ = 2 if dtype == torch.bfloat16 else 1
    panels, steps = -(-n // PANEL), -(-k // d_)
    packed = gemm.pack(w)
    assert packed.dtype == dtype and packed.is_contiguous()
    assert packed.shape == (panels, steps, PANEL * d_)
    split = _splits_panels(gemm, dtype)
    runs = packed.view(panels, PANEL // RUN, steps, RUN * d_)
    for p in range(panels):
        for s in range(steps):
            for c in range(PANEL):
                for d in range(d_):
                    row, col = p * PANEL + c, s * d_ + d
                    want = float(w[row, col]) if row < n and col < k else 0.0
                    got = (runs[p, c // RUN, s, (c % RUN) * d_ + d] if split
                           else packed[p, s, c * d_ + d])
                    assert float(got) == want, (p, s, c, d)


def test_tile_paths_follow_the_cpu() -> None:
    have = cpu_flags()
    avx512 = AVX512 <= have
    avx2 = "avx2" if {"avx2", "fma"} <= have else "portable"
    bf16_avx512 = "avx512" if "avx512_bf16" in have else "avx512_widen"
    want = {torch.float32: "avx512" if avx512 else avx2,
            torch.bfloat16: bf16_avx512 if avx512 else avx2}
    assert cpu_gemm.tile_paths() == want
    assert cpu_gemm.simd_dtypes() == {d for d, path in want.items() if path != "portable"}


@pytest.mark.slow
def test_portable_build_is_portable() -> None:
    _portable()
    ops = getattr(torch.ops, PORTABLE_NAMESPACE)
    assert list(ops.simd_dtypes()) == [] and list(ops.tile_paths()) == ["portable"] * 2


@pytest.mark.slow
def test_avx2_build_runs_the_avx2_tiles() -> None:
    if not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("the CPU has no AVX2 + FMA")
    if "avx512f" not in cpu_flags():  # the define changes nothing: the native build
        assert set(cpu_gemm.tile_paths().values()) == {"avx2"}
        return
    _avx2()
    assert list(getattr(torch.ops, AVX2_NAMESPACE).tile_paths()) == ["avx2"] * 2


@pytest.mark.slow
def test_widen_build_runs_the_widening_bf16_tiles() -> None:
    if not AVX512 <= cpu_flags():
        pytest.skip("the CPU has no AVX-512")
    if "avx512_bf16" not in cpu_flags():  # the define changes nothing: the native build
        assert cpu_gemm.tile_paths()[torch.bfloat16] == "avx512_widen"
        return
    _avx512_widen()
    assert list(getattr(torch.ops, WIDEN_NAMESPACE).tile_paths()) == ["avx512", "avx512_widen"]


GATED_SHAPES = [  # (M, I, K): SmolLM2's MLP, tails of I and K, several row blocks, K = 0
    (1, 1536, 576), (9, 1536, 576), (64, 1536, 576), (300, 100, 64), (3, 50, 37),
    (17, 1, 7), (2, 47, 1), (5, 49, 0),
]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m,i,k", GATED_SHAPES)
def test_linear_silu_is_silu_mul_of_the_linear(gemm: Build, dtype: torch.dtype, m: int, i: int,
                                               k: int, with_bias: bool) -> None:
    """The oracle is the unfused path the MLP takes otherwise: this build's linear over the
    whole gate_up weight, then cpu_fused.silu_mul (itself tested against F.silu(gate) *
    up): bit-equal, as the kernels share the rounding and the SiLU code."""
    if not cpu_fused.available():
        pytest.skip("the cpu_fused extension did not build")
    g = torch.Generator().manual_seed(m * 1000 + i + k)
    w = (torch.randn(2 * i, k, generator=g) * 0.1).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(2 * i, generator=g).to(dtype) if with_bias else None
    want = cpu_fused.silu_mul(gemm.linear(x, gemm.pack(w), 2 * i, bias))
    got = gemm.linear_silu(x, gemm.pack_gated(w), i, bias)
    assert got.shape == (m, i) and got.dtype == dtype
    assert torch.equal(got, want)


def test_linear_silu_matches_silu_mul_at_the_ends_of_exp(gemm: Build, dtype: torch.dtype) -> None:
    """Gates densely across the whole range of the SiLU's exp (both cut-offs, where exp
    overflows and underflows), signed zeros, infinities and NaN, 48 columns a row so the
    vector epilogue runs, not only its scalar tail: the same bits as cpu_fused.silu_mul
    (NaN where it has NaN)."""
    if not cpu_fused.available():
        pytest.skip("the cpu_fused extension did not build")
    specials = [-0.0, 0.0, 1e-30, -1e-30, float("inf"), float("-inf"), float("nan")]
    x = torch.cat([torch.linspace(-100.0, 100.0, 1601), torch.tensor(specials)]).view(-1, 1)
    scales = 1.0 + torch.arange(48) / 64.0  # gate = x * scale: K = 1, one exact product
    w = torch.cat([scales, torch.ones(48)]).view(96, 1)  # the gate rows, then the up rows
    x, w = x.to(dtype), w.to(dtype)
    want = cpu_fused.silu_mul(gemm.linear(x, gemm.pack(w), 96, None))
    got = gemm.linear_silu(x, gemm.pack_gated(w), 48, None)
    same = (got == want) | (got.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} of {same.numel()} outputs differ"


def test_pack_gated_layout() -> None:
    """Panel 2j holds gate rows [48 j, 48 j + 48) and panel 2j + 1 the same up rows,
    each zero past I: pack() of that row order."""
    w = torch.randn(2 * 50, 6)
    gate = torch.zeros(96, 6)
    up = torch.zeros(96, 6)
    gate[:50], up[:50] = w[:50], w[50:]
    rows = torch.stack([gate.view(2, PANEL, 6), up.view(2, PANEL, 6)], 1).reshape(4 * PANEL, 6)
    assert torch.equal(cpu_gemm.pack_gated(w), cpu_gemm.pack(rows))


def test_linear_silu_bad_inputs_raise_value_error() -> None:
    w, x = torch.randn(2 * 50, 64).bfloat16(), _x(2, 64, torch.bfloat16)
    gated = cpu_gemm.pack_gated(w)
    with pytest.raises(ValueError):  # a plain pack of the same weight: twice the panels
        cpu_gemm.linear_silu(x, cpu_gemm.pack(w[:50]), 50, None)
    with pytest.raises(ValueError):  # the bias of one half only
        cpu_gemm.linear_silu(x, gated, 50, torch.randn(50).bfloat16())
    with pytest.raises(ValueError):  # an odd number of rows has no gate/up halves
        cpu_gemm.pack_gated(torch.randn(7, 4))


BadCase = tuple[torch.Tensor, torch.Tensor, int, torch.Tensor | None]


def _bad_inputs() -> list[tuple[str, BadCase]]:
    bf, f32 = torch.bfloat16, torch.float32
    w = torch.randn(50, 64)
    x, b, p = _x(2, 64, bf), torch.randn(50).bfloat16(), cpu_gemm.pack(w.bfloat16())
    pf = cpu_gemm.pack(w)
    return [
        ("x fp16", (x.half(), p, 50, b)),
        ("packed fp16", (x, p.half(), 50, b)),
        ("x int", (x.int(), p, 50, None)),
        ("x fp32, packed bf16", (x.float(), p, 50, None)),
        ("x bf16, packed fp32", (x, pf, 50, None)),
        ("bias fp32", (x, p, 50, b.float())),
        ("bias bf16 for fp32", (x.float(), pf, 50, b)),
        ("bias shape", (x, p, 50, b[:49])),
        ("bias 2-D", (x, p, 50, b[None])),
        ("x 1-D", (x[0], p, 50, b)),
        ("x 3-D", (x[None], p, 50, b)),
        ("packed from K = 32", (x, cpu_gemm.pack(w[:, :32].bfloat16()), 50, b)),
        ("packed from K = 62, fp32", (_x(2, 64, f32), cpu_gemm.pack(w[:, :62]), 50, None)),
        ("packed from N = 100", (x, cpu_gemm.pack(torch.randn(100, 64).bfloat16()), 50,
                                 None)),
        ("packed from N = 40, n = 50", (x, cpu_gemm.pack(w[:40].bfloat16()), 50, b)),
        ("n negative", (x, p[:0], -1, None)),
        ("packed 2-D", (x, p[0], 50, b)),
        ("packed not contiguous", (x, p.transpose(0, 1).contiguous().transpose(0, 1), 50, b)),
        ("plain weight", (x, w.bfloat16(), 50, b)),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
def test_bad_inputs_raise_value_error(case: tuple[str, BadCase]) -> None:
    with pytest.raises(ValueError):
        cpu_gemm.linear(*case[1])


@pytest.mark.parametrize("weight", [torch.randn(8, 4).half(), torch.randn(8).bfloat16(),
                                    torch.randn(2, 8, 4), torch.ones(8, 4, dtype=torch.int32)],
                         ids=["fp16", "1-D", "3-D", "int32"])
def test_pack_rejects_bad_weights(weight: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        cpu_gemm.pack(weight)


def test_failed_build_is_reported_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_gemm, "_extension",
                        LazyExtension("cpu_gemm kernel", cpu_gemm.build_library))
    monkeypatch.setattr(cpu_gemm, "_SOURCE", tmp_path / "missing.cpp")
    assert not cpu_gemm.available() and not cpu_gemm.available()
    assert cpu_gemm.simd_dtypes() == frozenset()
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    with pytest.raises(RuntimeError, match="did not build"):
        cpu_gemm.linear(_x(1, 8, torch.float32), torch.zeros(1, 8, 48), 4, None)
