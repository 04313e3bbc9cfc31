"""kernels/flash_prefill.py: which steps go to FlashAttention, and (on a GPU) that it
matches the reference attention on fresh varlen prompts, with GQA and windows."""

from __future__ import annotations

import pytest
import torch

from kernels import flash_prefill, reference


@pytest.mark.parametrize("qsl,lens,first,fresh", [
    ([0, 1, 2, 7, 10], [40, 9, 5, 3], 2, True),  # two decodes, then two whole prompts
    ([0, 1, 2, 7, 10], [40, 9, 5, 8], 2, False),  # the last prompt has cached context
    ([0, 5], [5], 0, True),
    ([0, 1], [30], 1, True),  # no prefills at all
    ([0, 4, 8], [4, 12], 0, False),  # a chunk after the first
])
def test_fresh_prefills(qsl: list[int], lens: list[int], first: int, fresh: bool) -> None:
    assert flash_prefill.fresh_prefills(qsl, lens, first) is fresh


def test_not_usable_off_cuda_in_fp32_or_with_a_softcap() -> None:
    cpu_bf16 = torch.zeros(2, 4, 16, dtype=torch.bfloat16)
    assert not flash_prefill.flash_prefill_usable(cpu_bf16, None)
    meta = torch.zeros(2, 4, 16, dtype=torch.float32, device="meta")
    assert not flash_prefill.flash_prefill_usable(meta, None)


def test_this_torch_has_the_varlen_api_it_needs() -> None:
    # torch 2.13 (the CPU build here) has window_size, scale and enable_gqa; torch 2.11
    # (the GPU image) window_size and scale. If a build drops one, the backend falls
    # back to Triton and this says so
    found = flash_prefill._varlen_attn()
    assert found is not None
    import inspect

    has_gqa = "enable_gqa" in inspect.signature(found[0]).parameters
    assert found[1] == ({"enable_gqa": True} if has_gqa else {})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_the_reference_on_fresh_prompts(window: int | None, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    lens = [1, 17, 64, 130, 5]
    heads, kv_heads, dim = 8, 2, 64
    total = sum(lens)
    q = torch.randn(total, heads, dim, dtype=dtype, device="cuda")
    # k and v as views of a fused qkv output (rows not contiguous), as the model has them
    kv = torch.randn(total, 2 * kv_heads, dim, dtype=dtype, device="cuda")
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    scale = dim**-0.5
    assert flash_prefill.flash_prefill_usable(q, None)
    got = flash_prefill.flash_prefill(q, k, v, cu, max(lens), scale, window)
    start = 0
    for n in lens:
        want = reference.prefill_attention(q[start:start + n].float(), k[start:start + n].float(),
                                           v[start:start + n].float(), scale, window)
        torch.testing.assert_close(got[start:start + n].float(), want, atol=2e-2, rtol=2e-2)
        start += n
