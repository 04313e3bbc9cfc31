"""One step of a batch mixing decodes and prefills through the Triton backend and the
C++ CPU backend, with and without a sliding window and soft cap (as a Gemma 2 layer).

The torch backend (the CPU path, built on kernels.reference) is the oracle: same
new K/V, same caches, same metadata; both the attention output and the caches
after the write must agree. The long decode triggers split-K (small split size).
"""

from __future__ import annotations

import pytest
import torch

from kernel_cases import (
    DTYPES,
    assert_close,
    block_tables_for,
    device,
    require_triton,
    skip_unless_runnable,
)
from services.worker.attention.base import AttentionMetadata
from services.worker.attention.torch_backend import CpuAttentionBackend, TorchAttentionBackend

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 8, 2, 64


def _metadata(
    query_lens: list[int], seq_lens: list[int], num_decodes: int, gen: torch.Generator
) -> tuple[AttentionMetadata, int]:  # metadata (CPU tensors), num_blocks
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in seq_lens) + 2
    tables = block_tables_for(seq_lens, BLOCK_SIZE, num_blocks, gen)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    slots = []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        pos = torch.arange(s - q, s)
        slots.append(tables[i, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
    meta = AttentionMetadata(
        num_tokens=qsl[-1], num_decodes=num_decodes,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables,
        slot_mapping=torch.cat(slots), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_start_loc_host=qsl, seq_lens_host=list(seq_lens),
    )
    return meta, num_blocks


def _to(meta: AttentionMetadata, dev: torch.device) -> AttentionMetadata:
    return AttentionMetadata(
        meta.num_tokens, meta.num_decodes, meta.query_start_loc.to(dev), meta.seq_lens.to(dev),
        meta.block_tables.to(dev), meta.slot_mapping.to(dev), meta.max_query_len,
        meta.max_seq_len, meta.query_start_loc_host, meta.seq_lens_host,
    )


@require_triton
@pytest.mark.parametrize("window,softcap", [(None, None), (7, 1.5)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_decode_and_prefill_step_matches_torch_backend(
    dtype: torch.dtype, window: int | None, softcap: float | None
) -> None:
    skip_unless_runnable()
    from services.worker.attention.triton_backend import TritonAttentionBackend

    gen = torch.Generator().manual_seed(0)
    # decodes: context length 1, one past a block boundary, long (split-K);
    # prefills: a fresh prompt of exactly one block, a chunk after 27 cached tokens
    query_lens = [1, 1, 1, 16, 5]
    seq_lens = [1, 17, 130, 16, 32]
    meta, num_blocks = _metadata(query_lens, seq_lens, 3, gen)
    t = meta.num_tokens
    query = torch.randn(t, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    key = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    value = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_ref = torch.randn(shape, generator=gen).to(dtype)
    v_ref = torch.randn(shape, generator=gen).to(dtype)
    dev = device()
    k_dev, v_dev = k_ref.to(dev), v_ref.to(dev)  # copies: each backend writes its own
    scale = HEAD_DIM**-0.5

    if dev.type == "cpu":  # the interpreter pretends a 4-SM device: 3 x 2 programs split
        from kernels.paged_decode import choose_num_splits

        assert choose_num_splits(3, NUM_KV_HEADS, 130, num_sms=4, min_tokens_per_split=32) == 2
    triton_backend = TritonAttentionBackend(
        min_tokens_per_split=32, decode_tile_n=16, prefill_block_m=16, prefill_tile_n=16
    )
    out = triton_backend.forward(
        query.to(dev), key.to(dev), value.to(dev), k_dev, v_dev, _to(meta, dev), scale,
        window=window, softcap=softcap,
    )
    # the oracle in fp32 over the same rounded values
    k32, v32 = k_ref.float(), v_ref.float()
    ref = TorchAttentionBackend().forward(
        query.float(), key.float(), value.float(), k32, v32, meta, scale, window=window,
        softcap=softcap,
    )
    assert torch.equal(k_dev.cpu(), k32.to(dtype)) and torch.equal(v_dev.cpu(), v32.to(dtype)), (
        "caches differ after the write"
    )
    assert_close(out, ref, dtype, "mixed decode + prefill step")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_backend_layers_with_and_without_a_window_match_torch_backend(
    dtype: torch.dtype,
) -> None:
    """Three layers of one step, as Gemma 2 alternates them: windowed + soft-capped, full,
    windowed again. The backends keep per-step state (decode plans) that must be per
    window; the C++ kernels (or their fallbacks) against the torch path."""
    gen = torch.Generator().manual_seed(1)
    query_lens = [1, 1, 1, 16, 5]
    seq_lens = [1, 17, 130, 16, 32]
    meta, num_blocks = _metadata(query_lens, seq_lens, 3, gen)
    oracle_meta, _ = _metadata(query_lens, seq_lens, 3, torch.Generator().manual_seed(1))
    t = meta.num_tokens
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    cpu, oracle = CpuAttentionBackend(), TorchAttentionBackend()
    for layer, (window, softcap) in enumerate([(7, 1.5), (None, None), (20, None)]):
        query = torch.randn(t, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
        key = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        value = torch.randn(t, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        k_cache = torch.randn(shape, generator=gen).to(dtype)
        v_cache = torch.randn(shape, generator=gen).to(dtype)
        k32, v32 = k_cache.float(), v_cache.float()
        out = cpu.forward(query, key, value, k_cache, v_cache, meta, HEAD_DIM**-0.5,
                          window=window, softcap=softcap)
        ref = oracle.forward(query.float(), key.float(), value.float(), k32, v32, oracle_meta,
                             HEAD_DIM**-0.5, window=window, softcap=softcap)
        assert_close(out, ref, dtype, f"layer {layer}: window {window}, softcap {softcap}")
