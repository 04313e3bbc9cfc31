"""The torch references for sliding windows and attention soft caps against a naive oracle.

The oracle is the definition, one query at a time: a query at position p sees keys
p - window < j <= p (HF's sliding-window mask), scores are q.k * scale, then
cap * tanh(score / cap), then the softmax. Checked: ``reference.prefill_attention``
(fresh and over context, keys handed over from any start that covers the window, as the
torch backend slices them), ``reference.paged_attention`` and the batched
``reference.paged_decode_attention`` whose plan gathers only the window's blocks. The
C++ and Triton kernels are tested against these references in their own files.
"""

from __future__ import annotations

import pytest
import torch

from kernel_cases import assert_close, block_tables_for, paged_cache
from kernels import reference

CASES = [(None, None), (1, None), (5, None), (16, None), (None, 0.8), (7, 2.0)]  # window, cap


def _naive(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: list[int],
           scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """query [Q, H, D] at these positions; key/value [S, KV, D] from position 0."""
    group = query.shape[1] // key.shape[1]
    out = torch.empty_like(query)
    for i, p in enumerate(positions):
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(query.shape[1]):
            k, v = key[lo : p + 1, h // group], value[lo : p + 1, h // group]
            s = (k @ query[i, h]) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out[i, h] = torch.softmax(s, 0) @ v
    return out


@pytest.mark.parametrize("window,softcap", CASES)
@pytest.mark.parametrize("context_len", [0, 3, 21])
def test_prefill_reference(window: int | None, softcap: float | None, context_len: int) -> None:
    gen = torch.Generator().manual_seed(context_len)
    q_len, heads, kv_heads, dim = 13, 4, 2, 16
    seq_len = context_len + q_len
    query = torch.randn(q_len, heads, dim, generator=gen) * 2
    key = torch.randn(seq_len, kv_heads, dim, generator=gen)
    value = torch.randn(seq_len, kv_heads, dim, generator=gen)
    want = _naive(query, key, value, list(range(context_len, seq_len)), 0.3, window, softcap)
    got = reference.prefill_attention(query, key, value, 0.3, window, softcap)
    assert_close(got, want, torch.float32, f"prefill window={window} cap={softcap}")
    if window is not None:  # keys from the first query's window start on are enough
        first = max(0, context_len - window + 1)
        got = reference.prefill_attention(query, key[first:], value[first:], 0.3, window, softcap)
        assert_close(got, want, torch.float32, f"prefill from key {first}")


@pytest.mark.parametrize("window,softcap", CASES)
def test_paged_and_batched_decode_references(window: int | None, softcap: float | None) -> None:
    gen = torch.Generator().manual_seed(1)
    block_size, heads, kv_heads, dim = 4, 6, 2, 16
    seq_lens = [1, 3, 4, 5, 9, 30]  # on and off block boundaries, shorter and longer than windows
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 2
    tables = block_tables_for(seq_lens, block_size, num_blocks, gen)
    k, v = paged_cache(seq_lens, tables, num_blocks, block_size, kv_heads, dim, torch.float32, gen)
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    query = torch.randn(len(seq_lens), heads, dim, generator=gen) * 2
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    want = torch.cat([
        _naive(query[i : i + 1], reference.gather_kv(k, tables[i], n),
               reference.gather_kv(v, tables[i], n), [n - 1], 0.25, window, softcap)
        for i, n in enumerate(seq_lens)
    ])
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    paged = reference.paged_attention(query, k, v, qsl, lens, tables, 0.25, window, softcap)
    assert_close(paged, want, torch.float32, "paged_attention")
    batched = reference.paged_decode_attention(query, k, v, tables, lens, max(seq_lens), 0.25,
                                               window=window, softcap=softcap)
    assert_close(batched, want, torch.float32, "paged_decode_attention")


def test_windowed_decode_plan_gathers_only_the_window() -> None:
    tables = torch.arange(40, dtype=torch.int32).reshape(2, 20)  # block size 4: 80 positions
    lens = torch.tensor([70, 3], dtype=torch.int32)
    plan = reference.make_decode_plan(tables, lens, 70, 4, torch.float32, window=6)
    # 6 positions span at most 3 blocks of 4; row 0 sees 64..69 (logical blocks 16, 17),
    # row 1 sees 0..2 (block 0); the rest of each row is masked
    assert plan.padded_len == 12
    assert plan.block_index.tolist() == [[16, 17, 18], [20, 21, 22]]
    assert plan.mask is not None
    visible = (plan.mask[:, 0, 0] == 0).tolist()
    assert visible == [[True] * 6 + [False] * 6, [True] * 3 + [False] * 9]
