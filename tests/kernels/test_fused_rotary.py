"""The Triton rotary (kernels.fused_rotary) against ``reference.rotary``, the torch path
of ``layers/rotary.py`` (in Triton's interpreter without a GPU).

Cases: fp32 / fp16 / bf16; head_dim 64 and 128, whole heads and partial rotary (32 of
64; 96 of 128, a half of 48 that is no power of two); 6 query heads over 2 KV heads; q
and k the strided views llama.py splits off the qkv output; shuffled positions up to
4095 (far past the first rows of the tables), int64 and int32. The rotation must equal
torch's bit for bit, in place, with the pass-through dims and v untouched. Then the
module with its Triton path forced onto CPU tensors, against its torch path: default,
llama3, partial rotary, and the per-step tables of dynamic and longrope (``plan``, one
sequence past the rope's threshold, one below).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fused_cases import force_triton_path, spy

from kernel_cases import DTYPES, device, require_triton, skip_unless_runnable
from kernels import reference

pytestmark = require_triton

NUM_HEADS, NUM_KV_HEADS = 6, 2


def _qkv(num_tokens: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [T, (H + 2 H_kv) D] and its q [T, H, D] and k [T, H_kv, D] views (strided)."""
    q_size, kv_size = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen).to(device(), dtype)
    q = qkv[:, :q_size].view(num_tokens, NUM_HEADS, head_dim)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, NUM_KV_HEADS, head_dim)
    assert not q.is_contiguous() and not k.is_contiguous()
    return qkv, q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [(64, 64), (64, 32), (128, 128), (128, 96)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_rotary_equals_torch_in_place(
    dtype: torch.dtype, head_dim: int, rotary_dim: int, index_dtype: torch.dtype
) -> None:
    skip_unless_runnable()
    from kernels.fused_rotary import rotary_inplace

    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    num_tokens, rows = 7, 4096
    qkv, q, k = _qkv(num_tokens, head_dim, dtype, gen)
    angles = torch.rand(rows, rotary_dim // 2, generator=gen) * 6.3
    cos, sin = angles.cos().to(qkv.device), angles.sin().to(qkv.device)
    index = torch.randperm(rows, generator=gen)[:num_tokens].to(index_dtype)
    index[0] = rows - 1
    index = index.to(qkv.device)
    q_ref, k_ref = reference.rotary(q, k, index.long(), cos, sin)
    before = qkv.clone()
    rotary_inplace(q, k, index, cos, sin)
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref), "rotation differs from torch's"
    q_size = NUM_HEADS * head_dim
    v_start = q_size + NUM_KV_HEADS * head_dim
    assert torch.equal(qkv[:, v_start:], before[:, v_start:]), "v was written"
    if rotary_dim < head_dim:  # the pass-through dims are equal to torch's cat of them
        assert torch.equal(q[..., rotary_dim:], before[:, :q_size].view(q.shape)[..., rotary_dim:])


def test_rotary_no_tokens() -> None:
    skip_unless_runnable()
    from kernels.fused_rotary import rotary_inplace

    dev = device()
    q, k = torch.empty(0, 4, 64, device=dev), torch.empty(0, 2, 64, device=dev)
    table = torch.ones(8, 32, device=dev)
    rotary_inplace(q, k, torch.empty(0, dtype=torch.long, device=dev), table, table)


def _meta(positions_per_seq: list[list[int]]) -> Any:
    from services.worker.attention.base import AttentionMetadata

    lens = [p[-1] + 1 for p in positions_per_seq]
    starts = [0]
    for p in positions_per_seq:
        starts.append(starts[-1] + len(p))
    num_tokens = starts[-1]
    return AttentionMetadata(
        num_tokens=num_tokens, num_decodes=0, query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(lens), block_tables=torch.zeros(len(lens), 1, dtype=torch.int32),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.long), max_query_len=max(
            len(p) for p in positions_per_seq), max_seq_len=max(lens),
        query_start_loc_host=starts, seq_lens_host=lens)


LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 24,
            "short_factor": [1.0 + 0.1 * i for i in range(16)],
            "long_factor": [2.0 + 0.5 * i for i in range(16)]}
MODULES = {  # name: (rope_scaling, rotary_dim, positions of two sequences, plan expected)
    "default": (None, 32, [[0, 1, 2], [60, 61, 62, 63]], False),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0}, 32, [[5], [40, 41, 42]], False),
    "partial": (None, 24, [[3, 4], [63]], False),
    # max_position 64 is dynamic's threshold: the second sequence (80 long) gets its own base
    "dynamic": ({"rope_type": "dynamic", "factor": 2.0}, 32, [[0, 1, 2, 3], [77, 78, 79]], True),
    # past original_max_position_embeddings 24: the long factors' rows
    "longrope": (LONGROPE, 32, [[0, 1, 2], [30, 31, 32, 33]], True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_triton_path_equals_its_torch_path(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, name: str
) -> None:
    skip_unless_runnable()
    from kernels import fused_rotary
    from services.worker.layers import rotary as rotary_module
    from services.worker.layers.rotary import RotaryEmbedding

    scaling, rotary_dim, per_seq, planned = MODULES[name]
    asked = force_triton_path(monkeypatch, rotary_module)
    launched = spy(monkeypatch, fused_rotary, "rotary_inplace")
    head_dim = 32
    dev = device()
    fused, plain = (RotaryEmbedding(head_dim, 64, 10000.0, scaling, fused=f,
                                    rotary_dim=rotary_dim).to(dev) for f in (True, False))
    positions = torch.tensor([p for seq in per_seq for p in seq], device=dev)
    meta = _meta(per_seq)
    plan, plain_plan = fused.plan(positions, meta), plain.plan(positions, meta)
    assert (plan is not None) == planned
    gen = torch.Generator().manual_seed(len(name))
    _, q, k = _qkv(len(positions), head_dim, dtype, gen)
    q_ref, k_ref = plain(positions, q, k, plain_plan)  # new tensors: q, k untouched
    q_out, k_out = fused(positions, q, k, plan)
    assert q_out is q and k_out is k, "the Triton path rotates q and k in place"
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref), f"{name}: differs from torch"
    assert len(launched) == 1 and set(asked) == {(q.device, dtype)}
