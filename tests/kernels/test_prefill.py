"""The varlen paged prefill kernel against the reference oracle (reference.paged_attention).

Cases: fresh prompts (no context), chunked prefill and prefix hits (context on, one
past, and off a block boundary), a one-token chunk, GQA ratios 1/3/8, head_dim 64
and 128, block sizes 16 and 32, three dtypes, prefills that follow decodes in the
batch (query_start_loc passed as a slice, the decode rows left untouched), and sliding
windows (a tile's key walk starting at its first row's window) with attention soft caps.
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

pytestmark = require_triton


def _run_prefill(
    query_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
    head_dim: int, block_size: int, dtype: torch.dtype, seed: int = 0, num_leading: int = 0,
    window: int | None = None, softcap: float | None = None, **kwargs: int,
) -> None:
    """``num_leading`` first sequences are left to another kernel (decodes): not passed."""
    skip_unless_runnable()
    from kernels.prefill import paged_prefill_attention

    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    tables = block_tables_for(seq_lens, block_size, num_blocks, gen)
    k, v = paged_cache(seq_lens, tables, num_blocks, block_size, num_kv_heads, head_dim, dtype, gen)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    query = torch.randn(int(qsl[-1]), num_heads, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    scale = head_dim**-0.5
    dev = device()
    out = torch.full(query.shape, 7.0, dtype=dtype, device=dev)  # sentinel for skipped rows
    s = num_leading
    paged_prefill_attention(
        query.to(dev), k.to(dev), v.to(dev), qsl[s:].to(dev), lens[s:].to(dev),
        tables[s:].to(dev), max(query_lens[s:]), scale, out=out, window=window, softcap=softcap,
        **kwargs,
    )
    ref = reference.paged_attention(query.float(), k.float(), v.float(), qsl, lens, tables, scale,
                                    window, softcap)
    first = int(qsl[s])
    what = (f"prefill q={query_lens} seq={seq_lens} heads={num_heads}/{num_kv_heads} {kwargs} "
            f"window={window} softcap={softcap}")
    assert_close(out[first:], ref[first:], dtype, what)
    assert bool((out[:first] == 7.0).all()), f"{what}: rows of the leading sequences were written"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,block_size", [(64, 16), (128, 32)])
def test_prefill_fresh_and_with_context(dtype: torch.dtype, head_dim: int, block_size: int) -> None:
    bs = block_size
    # fresh prompt; chunk after context exactly on a block boundary; one past it;
    # a prefix hit ending mid-block; a one-token chunk after context
    query_lens = [bs + 1, 5, 2 * bs, 3, 1]
    seq_lens = [bs + 1, bs + 5, 3 * bs + 1, 2 * bs - 3, 2]
    _run_prefill(query_lens, seq_lens, 8, 2, head_dim, block_size, dtype, block_m=16, tile_n=16)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (16, 2)])
def test_prefill_gqa_ratios(num_heads: int, num_kv_heads: int) -> None:
    # group 3 does not divide BLOCK_M: the rows past BLOCK_Q * GROUP stay idle
    _run_prefill([20, 9], [20, 40], num_heads, num_kv_heads, 64, 16, torch.float32, seed=1,
                 block_m=16, tile_n=32)


def test_prefill_after_decodes_in_one_batch() -> None:
    # three decodes first (left to the decode kernel), then two prefills
    _run_prefill([1, 1, 1, 17, 6], [9, 33, 1, 17, 22], 4, 2, 64, 16, torch.float32, seed=2,
                 num_leading=3, block_m=32, tile_n=16)


@pytest.mark.parametrize("window,softcap", [(1, None), (6, None), (40, None), (None, 0.8),
                                            (9, 2.0)])
def test_prefill_window_and_softcap(window: int | None, softcap: float | None) -> None:
    # a fresh prompt past the window (later query tiles skip the first key tiles), a
    # chunk over context reaching back past it, a one-token chunk, a short fresh prompt
    _run_prefill([37, 12, 1, 3], [37, 50, 30, 3], 4, 2, 64, 16, torch.float32, seed=4,
                 window=window, softcap=softcap, block_m=16, tile_n=16)


def test_prefill_window_bf16_after_decodes() -> None:
    _run_prefill([1, 1, 20, 9], [9, 33, 20, 40], 4, 2, 64, 16, torch.bfloat16, seed=5,
                 num_leading=2, window=7, softcap=1.5, block_m=32, tile_n=16)


def test_prefill_larger_tiles_than_sequences() -> None:
    _run_prefill([3, 2], [3, 10], 4, 1, 64, 16, torch.bfloat16, seed=3, block_m=64, tile_n=64)
