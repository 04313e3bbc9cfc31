"""The Triton attention backend: the CUDA path (and the CPU under TRITON_INTERPRET=1).

Per layer and step: the cache-write kernel stores the new K/V in their slots, the
split-K decode kernel serves the ``num_decodes`` leading sequences, and the varlen
prefill kernel serves the rest (fresh prompts, chunks and prefix hits alike, all
read through the block table); both take the layer's sliding window and soft cap.
Kernel tile sizes are fixed at construction.

Fresh prompts: a step whose prefills have no cached context (every key is one of the
step's own new tokens) goes to torch's FlashAttention varlen kernel instead
(``kernels/flash_prefill.py``: CUDA, fp16/bf16, no soft cap), which the Triton prefill
kernel reached only 0.47-0.68x of on an H200 (``python -m kernels.bench``, beside torch
SDPA); chunks over cached context (0.86-0.92x there), fp32 and soft caps stay on Triton.
``flash_prefill=False`` keeps every prefill on Triton.

CUDA graphs: every launch reads its per-step values from the metadata's tensors (the
cache write skips slot -1, the decode kernel bounds each sequence by its seq_len), save
the decode split-K factor, chosen on the host from the longest sequence. For a graph
``prepare_graph`` replaces that length by a bound (``max_model_len``): the factor is
then fixed per batch size and layer window at capture, valid for every replayed step
(a split past a sequence's end is empty, and the reduce gives it weight 0).
"""

from __future__ import annotations

import torch

from kernels.cache_write import write_kv_cache
from kernels.flash_prefill import flash_prefill, flash_prefill_usable, fresh_prefills
from kernels.paged_decode import DEFAULT_MIN_TOKENS_PER_SPLIT, paged_decode_attention
from kernels.prefill import paged_prefill_attention
from kernels.triton_utils import HAS_TRITON
from services.worker.attention.base import AttentionBackend, AttentionMetadata

_GRAPH_MAX_SEQ_LEN = "graph_max_seq_len"  # backend_state key: prepare_graph's bound
_FRESH_PREFILLS = "fresh_prefills"  # backend_state key: the step's prefills are all fresh


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True

    def __init__(
        self,
        min_tokens_per_split: int = DEFAULT_MIN_TOKENS_PER_SPLIT,
        decode_tile_n: int = 64,
        prefill_block_m: int = 64,
        prefill_tile_n: int = 64,
        num_splits: int | None = None,  # force the decode split-K factor; None: heuristic
        flash_prefill: bool = True,  # fresh prompts through FlashAttention where usable
    ) -> None:
        if not HAS_TRITON:
            raise RuntimeError("the triton attention backend needs the triton package")
        self.min_tokens_per_split = min_tokens_per_split
        self.decode_tile_n = decode_tile_n
        self.prefill_block_m = prefill_block_m
        self.prefill_tile_n = prefill_tile_n
        self.num_splits = num_splits
        self.flash_prefill = flash_prefill

    def prepare_graph(self, meta: AttentionMetadata, max_seq_len: int) -> None:
        meta.backend_state[_GRAPH_MAX_SEQ_LEN] = max_seq_len

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
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd:
            # the split-K factor follows this length (the bound in a graph: see above)
            max_len = meta.backend_state.get(_GRAPH_MAX_SEQ_LEN) or max(meta.seq_lens_host[:nd])
            paged_decode_attention(
                query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                max_len, scale, out=out[:nd], num_splits=self.num_splits,
                min_tokens_per_split=self.min_tokens_per_split, tile_n=self.decode_tile_n,
                window=window, softcap=softcap,
            )
        if nd < meta.num_seqs and self._flash_fits(query, meta, softcap):
            start = meta.query_start_loc_host[nd]  # the prefills' tokens: start..end
            out[start:] = flash_prefill(query[start:], key[start:], value[start:],
                                        meta.query_start_loc[nd:] - start, meta.max_query_len,
                                        scale, window)
        elif nd < meta.num_seqs:
            # the prefills' query_start_loc values index query/out directly
            paged_prefill_attention(
                query, k_cache, v_cache, meta.query_start_loc[nd:], meta.seq_lens[nd:],
                meta.block_tables[nd:], meta.max_query_len, scale, out=out,
                block_m=self.prefill_block_m, tile_n=self.prefill_tile_n,
                window=window, softcap=softcap,
            )
        return out

    def _flash_fits(self, query: torch.Tensor, meta: AttentionMetadata,
                    softcap: float | None) -> bool:
        if not (self.flash_prefill and flash_prefill_usable(query, softcap)):
            return False
        fresh = meta.backend_state.get(_FRESH_PREFILLS)  # once a step, not once a layer
        if fresh is None:
            fresh = meta.backend_state[_FRESH_PREFILLS] = fresh_prefills(
                meta.query_start_loc_host, meta.seq_lens_host, meta.num_decodes)
        return bool(fresh)
