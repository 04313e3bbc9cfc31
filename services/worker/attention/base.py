"""The attention-backend interface the model layers call, and the per-step metadata.

The model runner builds one ``AttentionMetadata`` per step; every layer's attention
hands its new q/k/v and its layer's cache to ``AttentionBackend.forward``, which
writes the new K/V into their slots and attends over context + new tokens.

Per layer, a backend also honours the layer's sliding window (a query at position p
sees keys p - window < j <= p; None: every earlier key) and attention-logit soft cap
(scores -> cap * tanh(scores / cap) before the softmax; Gemma 2). The KV cache of a
windowed layer stays full-size: keys left behind by the window are kept, not read.

Batch order: the runner puts the ``num_decodes`` sequences with exactly one new
token first, then the prefills (whole prompts, chunks, or the rest of a prompt
after a prefix-cache hit), so a backend can treat each group in one piece.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int
    num_decodes: int  # the first num_decodes sequences (and tokens) are decodes
    query_start_loc: torch.Tensor  # [batch + 1] int32: sequence i owns tokens qsl[i]:qsl[i+1]
    seq_lens: torch.Tensor  # [batch] int32: tokens in the cache after this step
    block_tables: torch.Tensor  # [batch, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token
    max_query_len: int
    max_seq_len: int
    # host copies, so a backend can split work without a device sync
    query_start_loc_host: list[int]
    seq_lens_host: list[int]
    # per-step work a backend shares between layers (e.g. a gather plan); starts empty
    backend_state: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)


class AttentionBackend(ABC):
    """One implementation of paged attention (torch on the CPU, Triton on CUDA).

    CUDA graphs (``services/worker/cuda_graphs.py``) capture the decode forward once per
    batch size over persistent input buffers and replay it for later steps, so inside a
    captured forward a backend may read the metadata's tensors only: the host lists
    hold capture-time values, and a host sync would abort the capture. A backend that
    keeps to this on decode-only batches says so with ``supports_cuda_graphs``; the
    graph runner hands every metadata it builds (for capture, and for the same padded
    path run eagerly) to ``prepare_graph`` first. Replay needs no hook: the runner
    refreshes the buffers the captured kernels read.
    """

    name: str
    supports_cuda_graphs: bool = False

    def prepare_graph(self, meta: AttentionMetadata, max_seq_len: int) -> None:
        """Fix in ``meta.backend_state`` every launch choice ``forward`` would otherwise
        derive from the host lists, so that it holds for any decode-only step of this
        batch size whose sequences are at most ``max_seq_len`` long. Default: none."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,  # sliding window of this layer, None: full attention
        softcap: float | None = None,  # attention-logit soft cap, None: none
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write the new K/V into the cache, then attend (causal, over the context)."""
