"""``layers.linear``: which kernel a CPU linear runs, and that each agrees with fp32 torch.

bf16 at up to GEMV_MAX_ROWS rows streams the plain weight through ``kernels.cpu_gemv``;
more rows, and fp32 at any count, use oneDNN's packed weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_gemv
from services.worker.layers.linear import GEMV_MAX_ROWS, linear, pack_weight

pytestmark = pytest.mark.skipif(pack_weight(torch.ones(8, 8)) is None,
                                reason="oneDNN weight packing unavailable")


def _case(dtype: torch.dtype, rows: int, bias: bool):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 576, generator=g).to(dtype)
    w = (torch.randn(960, 576, generator=g) * 0.05).to(dtype)
    b = (torch.randn(960, generator=g) * 0.1).to(dtype) if bias else None
    return x, w, b, pack_weight(w)


@pytest.mark.skipif(not cpu_gemv.available(), reason="the cpu_gemv extension did not build")
@pytest.mark.parametrize("rows", [1, 3, GEMV_MAX_ROWS])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_few_rows_run_the_gemv_kernel(rows: int, bias: bool) -> None:
    x, w, b, packed = _case(torch.bfloat16, rows, bias)
    got = linear(x, w, b, packed)
    assert torch.equal(got, cpu_gemv.linear_bf16(x, w, b))  # that kernel, bit for bit
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize(("dtype", "rows"), [(torch.bfloat16, GEMV_MAX_ROWS + 1),
                                             (torch.bfloat16, 64), (torch.float32, 1)])
def test_more_rows_and_fp32_run_onednn(dtype: torch.dtype, rows: int) -> None:
    x, w, b, packed = _case(dtype, rows, True)
    got = linear(x, w, b, packed)
    assert torch.equal(got, torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], ""))
    want = F.linear(x.float(), w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_without_a_packed_weight_it_is_f_linear() -> None:
    x, w, b, _ = _case(torch.bfloat16, 2, True)
    assert torch.equal(linear(x, w, b, None), F.linear(x, w, b))
