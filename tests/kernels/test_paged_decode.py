"""The split-K paged decode kernel against the reference oracle (reference.paged_attention).

Cases: random non-contiguous block tables, context length 1, lengths on and one past
a block boundary, GQA ratios 1/3/4/16, head_dim 64 and 128, block sizes 16 and 32,
three dtypes, forced or heuristic split-K with empty splits, and sliding windows (whose
splits start at the window's tile) with attention soft caps.
"""

from __future__ import annotations

import pytest
import torch

from kernel_cases import (
    DTYPES,
    assert_close,
    block_tables_for,
    device,
    paged_cache,
    require_triton,
    skip_unless_runnable,
)
from kernels import reference


def _run_decode(
    seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype, seed: int = 0, window: int | None = None, softcap: float | None = None,
    **kwargs: int,
) -> None:
    skip_unless_runnable()
    from kernels.paged_decode import paged_decode_attention

    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    tables = block_tables_for(seq_lens, block_size, num_blocks, gen)
    k, v = paged_cache(seq_lens, tables, num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    dev = device()
    out = paged_decode_attention(
        query.to(dev), k.to(dev), v.to(dev), tables.to(dev), lens.to(dev), max(seq_lens), scale,
        window=window, softcap=softcap, **kwargs,
    )
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    ref = reference.paged_attention(query.float(), k.float(), v.float(), qsl, lens, tables, scale,
                                    window, softcap)
    what = (f"decode lens={seq_lens} heads={num_heads}/{num_kv_heads} {kwargs} "
            f"window={window} softcap={softcap}")
    assert_close(out, ref, dtype, what)


@require_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32)])
def test_decode_boundaries(dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    # length 1, exactly one block, one past it, two blocks, and a ragged one
    lens = [1, block_size, block_size + 1, 2 * block_size, 3 * block_size - 5]
    _run_decode(lens, 8, 2, head_dim, block_size, dtype, tile_n=16)


@require_triton
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (32, 2)])
def test_decode_gqa_ratios(num_heads: int, num_kv_heads: int) -> None:
    # group 1 (MHA), 3 (SmolLM2: not a power of two) and 16 (a large GQA ratio)
    _run_decode([7, 40, 16], num_heads, num_kv_heads, 64, 16, torch.float32, seed=1, tile_n=32)


@require_triton
@pytest.mark.parametrize("num_splits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_split_k(num_splits: int, dtype: torch.dtype) -> None:
    # a short sequence beside long ones leaves splits empty (lse = -inf in the reduce)
    _run_decode([150, 1, 97, 33], 8, 2, 64, 16, dtype, seed=2, num_splits=num_splits, tile_n=16)


@require_triton
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("window,softcap", [(5, None), (40, None), (None, 0.8), (20, 2.0)])
def test_decode_window_and_softcap(num_splits: int, window: int | None,
                                   softcap: float | None) -> None:
    # windows starting mid-tile and before short sequences; with splits over the window's
    # tiles only, some of them empty
    _run_decode([150, 1, 17, 40], 8, 2, 64, 16, torch.float32, seed=4, window=window,
                softcap=softcap, num_splits=num_splits, tile_n=16)


@require_triton
def test_decode_window_bf16() -> None:
    _run_decode([70, 9], 4, 2, 64, 16, torch.bfloat16, seed=5, window=24, softcap=1.5, tile_n=16)


@require_triton
def test_decode_heuristic_splits_long_context() -> None:
    from kernels.paged_decode import choose_num_splits

    # batch 2 x 2 KV heads cannot fill the (pretend) device: the heuristic splits
    assert choose_num_splits(2, 2, 200, num_sms=4, min_tokens_per_split=32) > 1
    _run_decode([200, 65], 4, 2, 64, 16, torch.float32, seed=3, min_tokens_per_split=32, tile_n=16)


@pytest.mark.parametrize(
    "batch,kv_heads,max_len,sms,expected",
    [
        (256, 8, 32768, 132, 1),  # enough programs already: never split
        (64, 8, 1024, 132, 1),  # 512 programs: two per SM and more
        (1, 8, 32768, 132, 32),  # one long sequence: split up to the cap
        (1, 8, 1024, 132, 8),  # splits of at least 128 tokens
        (4, 8, 200, 132, 1),  # too short to split
        (3, 8, 32768, 132, 8),  # ceil(264 / 24) = 11 rounds down to a power of two
    ],
)
def test_choose_num_splits(
    batch: int, kv_heads: int, max_len: int, sms: int, expected: int
) -> None:
    # pure Python behind the import guard: runs without Triton too
    from kernels.paged_decode import choose_num_splits

    assert choose_num_splits(batch, kv_heads, max_len, sms) == expected
