"""Fresh-prompt prefill through torch's FlashAttention varlen kernel (CUDA, fp16/bf16).

On an H200 the Triton varlen prefill kernel (``kernels/prefill.py``) ran at 0.47-0.68x
torch SDPA (FlashAttention) on fresh prompts and at 0.86-0.92x over cached context. A
step whose prefills are all fresh (no cached context: every key is one of the step's
own new tokens) needs plain causal varlen attention over the step's contiguous k and
v, which is what ``torch.nn.attention.varlen.varlen_attn`` computes with the
FlashAttention kernels torch ships: no extra package. Chunks over cached context,
float32, soft caps (not exposed by torch's API), head sizes over 256 or GPUs before
sm80 (FlashAttention 2's limits) and torch builds whose ``varlen_attn`` lacks
``window_size`` or ``scale`` (torch 2.10 took ``is_causal``) stay on the Triton kernel:
``flash_prefill_usable`` decides, ``fresh_prefills`` tells a fresh step from the
metadata's host lists, without a device sync. ``enable_gqa`` (torch 2.12 on) is passed
where it exists; before it, torch hands k and v to FlashAttention as they are, which
takes fewer KV heads than query heads natively.

Reference: ``reference.prefill_attention`` per sequence.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

import torch

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
_NEEDED_PARAMETERS = ("window_size", "scale")


@lru_cache(maxsize=1)
def _varlen_attn() -> tuple[Callable[..., Any], dict[str, Any]] | None:
    """torch's varlen_attn and the optional keywords to pass it where its signature has
    what this module needs, else None (torch 2.10's took ``is_causal`` instead of
    ``window_size``; older ones had none)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if not all(p in params for p in _NEEDED_PARAMETERS):
        return None
    return varlen_attn, ({"enable_gqa": True} if "enable_gqa" in params else {})


@lru_cache(maxsize=8)
def _sm80_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)


def flash_prefill_usable(query: torch.Tensor, softcap: float | None) -> bool:
    """Whether this layer's fresh prefills can run on FlashAttention."""
    return (query.is_cuda and query.dtype in FLASH_DTYPES and softcap is None
            and query.shape[-1] <= FLASH_MAX_HEAD_DIM and _varlen_attn() is not None
            and _sm80_or_later(query.device))


def fresh_prefills(query_start_loc: Sequence[int], seq_lens: Sequence[int],
                   first: int) -> bool:
    """Whether sequences ``first``.. (the step's prefills) have no cached context: each
    one's new tokens are all its tokens."""
    return all(seq_lens[i] == query_start_loc[i + 1] - query_start_loc[i]
               for i in range(first, len(seq_lens)))


def flash_prefill(
    query: torch.Tensor,  # [T, num_heads, head_dim]: the prefills' tokens only
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]: the same tokens' new keys
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,  # [num_prefills + 1] int32 on the device, from 0
    max_len: int,
    scale: float,
    window: int | None = None,  # query at p sees keys p - window < j <= p
) -> torch.Tensor:  # [T, num_heads, head_dim]
    found = _varlen_attn()
    if found is None:
        raise RuntimeError("this torch build has no usable torch.nn.attention.varlen")
    varlen_attn, extra = found
    # FlashAttention's window counts keys left of the query: ours counts the query too
    left = -1 if window is None else window - 1
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=scale,
                       window_size=(left, 0), **extra)
