"""The small-batch bf16 linear (kernels.cpu_gemv) against torch in fp32.

Oracle: ``F.linear(x.float(), W.float(), b.float()).bfloat16()``, the same exact bf16
products summed in fp32 (in another order) and rounded once. So every output must be
within 1e-2 relative of it (a bf16 ulp is 2^-8..2^-7 relative), plus a few fp32 ulps of
the sum of |products| for outputs that cancel to near zero; and at least 99 % of the
outputs (all but one of a small output) must be bit-equal to it (``bf16_ulps`` == 0): the
two fp32 sums differ by a few fp32 ulps, which changes the bf16 rounding only within
that distance of a tie (~1e-4 of random outputs), while an error of half a bf16 ulp
would change about half of them.

Cases, for the AVX512-BF16 build (or the portable one where the CPU lacks it) and the
portable build forced with PAGODA_PORTABLE (slow: a second compile): the five linears
of SmolLM2-135M at M = 1, 2, 4, 8, odd shapes (N, K, M = 1, K tails of 1..31, M = 17
over several x tiles and row blocks, K = 0, empty), with and without bias; x rows
a slice of a wider tensor, x transposed; results independent of the thread count;
ValueError for inputs the op does not take; a failed build reported once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kernel_cases import cpu_flags
from kernels import cpu_gemv
from kernels.cpu_extension import LazyExtension
from tests.support.linear_oracle import assert_linear_matches

if not cpu_gemv.available():
    pytest.skip("the cpu_gemv extension did not build", allow_module_level=True)

Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
PORTABLE_NAMESPACE = "pagoda_cpu_gemv_portable"
# SmolLM2-135M: qkv, o, gate_up, down, lm_head as (N, K)
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
_WEIGHTS: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _portable() -> Linear:
    cpu_gemv.build_library(PORTABLE_NAMESPACE, defines=("PAGODA_PORTABLE",))
    return getattr(torch.ops, PORTABLE_NAMESPACE).linear_bf16  # type: ignore[no-any-return]


@pytest.fixture(
    scope="module",
    params=["native", pytest.param("portable", marks=pytest.mark.slow)],
)
def linear(request: pytest.FixtureRequest) -> Linear:
    return cpu_gemv.linear_bf16 if request.param == "native" else _portable()


@pytest.fixture(scope="module", autouse=True)
def _drop_weights() -> Iterator[None]:
    yield
    _WEIGHTS.clear()  # ~60 MB: not for the rest of the session


def _weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:  # W [N, K], bias [N]
    """Model-like weights, made once per shape (the lm_head's take a while)."""
    if (n, k) not in _WEIGHTS:
        gen = torch.Generator().manual_seed(n * 7919 + k)
        w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
        _WEIGHTS[(n, k)] = w, (torch.randn(n, generator=gen) * 0.1).bfloat16()
    return _WEIGHTS[(n, k)]


def _x(m: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("n,k", MODEL_SHAPES)
def test_model_shapes(linear: Linear, n: int, k: int, with_bias: bool) -> None:
    w, b = _weights(n, k)
    bias = b if with_bias else None
    for m in (1, 2, 4, 8):
        x = _x(m, k, seed=m)
        assert_linear_matches(linear(x, w, bias), x, w, bias, f"[{n} x {k}] M={m} bias={with_bias}")


ODD_SHAPES = [  # (M, N, K)
    *[(m, n, k) for m in (1, 3, 17) for n in (1, 7, 100) for k in (1, 33, 100)],
    (2, 5, 31), (5, 16, 32), (6, 17, 63), (7, 33, 65), (8, 15, 97),  # K tails, tile edges
    (17, 1000, 576), (9, 300, 200), (12, 1, 576),  # several x tiles and row blocks
]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("m,n,k", ODD_SHAPES)
def test_odd_shapes(linear: Linear, m: int, n: int, k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 10007 + n * 101 + k)
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    assert_linear_matches(linear(x, w, bias), x, w, bias, f"M={m} N={n} K={k} bias={with_bias}")


def test_empty_and_k0(linear: Linear) -> None:
    bias = torch.randn(5).bfloat16()
    out = linear(torch.empty(2, 0, dtype=torch.bfloat16), torch.empty(5, 0, dtype=torch.bfloat16),
                 bias)
    assert torch.equal(out, bias.expand(2, 5))  # no products: the bias alone
    w = torch.randn(5, 8).bfloat16()
    assert linear(torch.empty(0, 8, dtype=torch.bfloat16), w, None).shape == (0, 5)
    assert linear(_x(3, 8), w[:0], None).shape == (3, 0)


def test_strided_x(linear: Linear) -> None:
    w, b = _weights(576, 576)
    wide = _x(4, 700)
    x = wide[:, 50:626]  # rows 700 apart, as a slice of a fused projection
    assert x.stride() == (700, 1)
    assert_linear_matches(linear(x, w, b), x, w, b, "row stride 700")
    xt = _x(576, 3).t()  # stride (1, 3): copied first
    assert_linear_matches(linear(xt, w, b), xt, w, b, "transposed x")


def test_thread_count_does_not_change_results() -> None:
    w, b = _weights(3072, 576)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, max(2, threads)):
            torch.set_num_threads(t)
            outs.append([cpu_gemv.linear_bf16(_x(m, 576), w, b) for m in (1, 8, 17)])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, c) for a, c in zip(*outs, strict=True))


def test_native_build_uses_avx512_bf16_where_the_cpu_has_it() -> None:
    assert cpu_gemv.uses_avx512_bf16() == ("avx512_bf16" in cpu_flags())


@pytest.mark.slow
def test_portable_build_is_portable() -> None:
    _portable()
    assert not getattr(torch.ops, PORTABLE_NAMESPACE).uses_avx512_bf16()


def _bad_inputs() -> list[tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]]:
    x, w, b = _x(2, 64), torch.randn(8, 64).bfloat16(), torch.randn(8).bfloat16()
    return [
        ("x float32", (x.float(), w, b)),
        ("weight float32", (x, w.float(), b)),
        ("bias float32", (x, w, b.float())),
        ("x fp16", (x.half(), w, None)),
        ("K mismatch", (x, w[:, :32].contiguous(), b)),
        ("weight not contiguous", (x, torch.randn(64, 8).bfloat16().t(), b)),
        ("weight column slice", (x[:, :32].contiguous(), w[:, ::2], b)),
        ("bias shape", (x, w, b[:7])),
        ("bias 2-D", (x, w, b[None])),
        ("x 1-D", (x[0], w, b)),
        ("x 3-D", (x[None], w, b)),
        ("weight 1-D", (x, w[0], None)),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
def test_bad_inputs_raise_value_error(
    case: tuple[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
) -> None:
    with pytest.raises(ValueError):
        cpu_gemv.linear_bf16(*case[1])


def test_failed_build_is_reported_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu_gemv, "_extension",
                        LazyExtension("cpu_gemv kernel", cpu_gemv.build_library))
    monkeypatch.setattr(cpu_gemv, "_SOURCE", tmp_path / "missing.cpp")
    assert not cpu_gemv.available() and not cpu_gemv.available()
    assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1
    with pytest.raises(RuntimeError, match="did not build"):
        cpu_gemv.linear_bf16(_x(1, 8), torch.randn(4, 8).bfloat16(), None)
