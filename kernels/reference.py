"""Torch implementations of every paged-KV kernel and of the decoder layer's small fused
ops: the torch paths of the worker and the oracle of the kernels.

The worker's torch attention backend runs the attention functions on the CPU, and the
layers (``services/worker/layers/norm.py``, ``rotary.py``, the MLP of ``models/
llama.py``) run ``rms_norm``, ``rotary`` and ``act_mul`` wherever no fused kernel
applies; the Triton kernels in this package (``fused_*.py`` for the small ops) are
tested against them. Cache layout everywhere (per layer):

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

A token at logical position ``p`` of a sequence lives in physical block
``block_table[p // block_size]`` at offset ``p % block_size``; its flat slot is
``block_id * block_size + offset``. Slot -1 marks a padded token that is not written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Rows of the batched decode are processed in groups so that the gathered K/V stays
# near this many elements (fp32: 4 bytes each) instead of growing with batch x context;
# 16 MiB chunks also stay under glibc's largest mmap threshold, so the CPU worker's
# allocator reuses them instead of faulting fresh pages in every layer.
_DECODE_GATHER_ELEMS = 4 * 1024 * 1024


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Store each token's K/V in its slot (reshape_and_cache)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    flat_k = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_v = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        slot_mapping, key, value = slot_mapping[valid], key[valid], value[valid]
    flat_k.index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    flat_v.index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_blocks_of_seq] int
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.flatten(0, 1)[:seq_len]


@dataclass
class DecodePlan:
    """What every layer's batched decode shares within one step (built once per step and
    window: the sliding layers of a model get their own plan)."""

    # [batch, max_blocks] int64: the physical blocks gathered for each row, logical block
    # first_block[b] + j (all from block 0 without a window)
    block_index: torch.Tensor
    # [batch, 1, 1, padded_len] additive (0 / -inf) in the query dtype, None when every
    # gathered position is visible (nothing to mask)
    mask: torch.Tensor | None
    padded_len: int


def make_decode_plan(
    block_tables: torch.Tensor,  # [batch, max_blocks_per_seq] int
    seq_lens: torch.Tensor,  # [batch] int
    max_seq_len: int,
    block_size: int,
    dtype: torch.dtype,
    window: int | None = None,  # a decode token sees its last `window` positions only
) -> DecodePlan:
    max_blocks = (max_seq_len + block_size - 1) // block_size
    if window is None:
        first = torch.zeros_like(seq_lens, dtype=torch.int64)
    else:  # the blocks of positions [seq_len - window, seq_len): at most this many
        max_blocks = min(max_blocks, (window + block_size - 2) // block_size + 1)
        first = (seq_lens.long() - window).clamp(min=0) // block_size  # [batch]
    padded_len = max_blocks * block_size
    cols = first[:, None] + torch.arange(max_blocks, device=seq_lens.device)  # [batch, max_blocks]
    cols = cols.clamp(max=block_tables.shape[1] - 1)  # past a row's end: masked below
    block_index = block_tables.long().gather(1, cols)
    positions = first[:, None] * block_size + torch.arange(padded_len, device=seq_lens.device)
    valid = positions < seq_lens[:, None]  # [batch, padded_len]
    if window is not None:
        valid &= positions >= seq_lens[:, None] - window
    mask = None
    if not bool(valid.all()):
        mask = torch.zeros(valid.shape, dtype=dtype, device=seq_lens.device)
        mask.masked_fill_(~valid, float("-inf"))
        mask = mask[:, None, None, :]
    return DecodePlan(block_index, mask, padded_len)


def attend(
    q: torch.Tensor,  # [..., heads, q_len, D]
    k: torch.Tensor,  # [..., kv_heads, k_len, D], q's dtype
    v: torch.Tensor,  # [..., kv_heads, k_len, D]
    mask: torch.Tensor | None,  # bool (True: visible) or additive, broadcast to the scores
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:  # [..., heads, q_len, D]
    """SDPA, or with a soft cap the eager attention of HF's Gemma 2: scores * scale, then
    cap * tanh(scores / cap), then the mask, softmax in fp32 (SDPA has no soft cap).
    Query head h reads KV head h // (heads // kv_heads)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=q.shape[-3] != k.shape[-3])
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def paged_decode_attention(
    query: torch.Tensor,  # [batch, num_heads, head_dim]: one new token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [batch, max_blocks_per_seq] int
    seq_lens: torch.Tensor,  # [batch] int: tokens in the cache, the new one included
    max_seq_len: int,
    scale: float,
    plan: DecodePlan | None = None,  # the same step's plan, shared by every layer
    window: int | None = None,  # sliding window (the plan's, when one is given)
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
) -> torch.Tensor:  # [batch, num_heads, head_dim]
    """Batched decode over padded gathered K/V; no Python loop over sequences.

    The query heads that share a KV head are laid out as that head's query rows
    ([batch, kv_heads, group, head_dim]), so K/V are gathered once per KV head
    and no causal mask is needed: a decode token sees its whole context (or, with a
    window, the window's blocks are gathered and the positions outside it masked).
    Blocks are gathered with ``index_select`` on the block dimension (contiguous block
    copies; advanced indexing over the 4-D cache is several times slower on the CPU).
    """
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    if plan is None:
        plan = make_decode_plan(block_tables, seq_lens, max_seq_len, block_size, query.dtype,
                                window)
    padded_len = plan.padded_len
    rows_per_chunk = max(1, _DECODE_GATHER_ELEMS // (padded_len * num_kv_heads * head_dim))
    out = torch.empty_like(query)
    for start in range(0, batch, rows_per_chunk):
        end = min(batch, start + rows_per_chunk)
        b = end - start
        blocks = plan.block_index[start:end].reshape(-1)
        # [b * max_blocks, block_size, kv_heads, D] -> [b, kv_heads, padded_len, D]
        k = k_cache.index_select(0, blocks).view(b, padded_len, num_kv_heads, head_dim).transpose(1, 2)
        v = v_cache.index_select(0, blocks).view(b, padded_len, num_kv_heads, head_dim).transpose(1, 2)
        q = query[start:end].view(b, num_kv_heads, group, head_dim)
        mask = None if plan.mask is None else plan.mask[start:end]
        o = attend(q, k.to(q.dtype), v.to(q.dtype), mask, scale, softcap)
        out[start:end] = o.reshape(b, num_heads, head_dim)
    return out


def prefill_attention(
    query: torch.Tensor,  # [query_len, num_heads, head_dim]
    key: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]: context then new tokens
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    scale: float,
    window: int | None = None,  # query at position p sees keys p - window < j <= p
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
) -> torch.Tensor:  # [query_len, num_heads, head_dim]
    """Causal attention of the last query_len tokens of a sequence over all of it.

    Positions only matter relative to each other, so ``key`` may start anywhere in the
    sequence as long as it covers every key the first query sees."""
    query_len, seq_len = query.shape[0], key.shape[0]
    context_len = seq_len - query_len
    q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, D]
    k = key.to(query.dtype).transpose(0, 1).unsqueeze(0)
    v = value.to(query.dtype).transpose(0, 1).unsqueeze(0)
    if context_len == 0 and window is None and softcap is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # query i sits at position context_len + i and sees keys 0..context_len + i
        rows = torch.arange(query_len, device=query.device)[:, None] + context_len
        cols = torch.arange(seq_len, device=query.device)[None, :]
        mask = cols <= rows
        if window is not None:
            mask &= cols > rows - window
        o = attend(q, k, v, mask, scale, softcap)
    return o.squeeze(0).transpose(0, 1)


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]: all new tokens, flattened
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,  # [batch + 1] int: sequence i owns query[qsl[i]:qsl[i+1]]
    seq_lens: torch.Tensor,  # [batch] int: context + new tokens
    block_tables: torch.Tensor,  # [batch, max_blocks_per_seq] int
    scale: float,
    window: int | None = None,  # sliding window: query at p sees keys p - window < j <= p
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """The plain oracle: each sequence's K/V gathered through its block table.

    Serves decode, prefill and prefill over cached context (chunked prefill,
    prefix-cache hits) alike; the new tokens' K/V must already be in the cache.
    """
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q = query[starts[i] : starts[i + 1]]
        k = gather_kv(k_cache, block_tables[i], seq_len)
        v = gather_kv(v_cache, block_tables[i], seq_len)
        out[starts[i] : starts[i + 1]] = prefill_attention(q, k, v, scale, window, softcap)
    return out


def rms_norm(
    x: torch.Tensor,  # [..., H]
    residual: torch.Tensor | None,  # like x, or None
    weight: torch.Tensor,  # [H]; with unit_offset, Gemma's 1 + w in fp32
    eps: float,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # norm(x + residual), x + residual
    """RMSNorm as HF computes it: the sum rounded to x's dtype, the norm in fp32, rounded
    to x's dtype, then times the weight (one more rounding, in the promoted dtype); with
    unit_offset the fp32 scale applies before the one rounding. residual None: x alone
    (returned as the new residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (xf * weight).to(x.dtype), x
    return weight * xf.to(x.dtype), x


def rotary(
    query: torch.Tensor,  # [T, num_heads, head_dim]
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    index: torch.Tensor,  # [T] int: the table row of each token (its position, as a rule)
    cos_table: torch.Tensor,  # [rows, rotary_dim / 2], fp32
    sin_table: torch.Tensor,  # [rows, rotary_dim / 2], fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # new contiguous tensors, shaped as the inputs
    """Rotate-half rotary embedding (HF Llama) of the first rotary_dim dims of each head
    (the rest pass through), in fp32, rounded once to the input dtype."""
    cos = cos_table.index_select(0, index)[:, None, :]  # [T, 1, R/2]
    sin = sin_table.index_select(0, index)[:, None, :]
    r = 2 * cos_table.shape[-1]
    if r < query.shape[-1]:
        return (torch.cat((_rotate(query[..., :r], cos, sin), query[..., r:]), dim=-1),
                torch.cat((_rotate(key[..., :r], cos, sin), key[..., r:]), dim=-1))
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def act_mul(gate_up: torch.Tensor, gelu: bool = False) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """The gated MLP activation: ``silu(gate) * up`` (SwiGLU), or with ``gelu`` the tanh
    GELU (GeGLU, Gemma), gate and up the two halves of each row."""
    gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
    if gelu:
        return F.gelu(gate, approximate="tanh") * up
    return F.silu(gate) * up
