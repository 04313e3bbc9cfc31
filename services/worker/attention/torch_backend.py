"""The torch attention backend: the CPU path (and a fallback anywhere torch runs).

Decodes go through one batched call over gathered K/V; each prefill goes through
SDPA, on the fresh K/V when it has no cached context and on K/V gathered from the
cache when it does (chunked prefill, prefix-cache hits).
"""

from __future__ import annotations

import torch

from kernels import reference
from services.worker.attention.base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        reference.write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd:
            max_decode_len = max(meta.seq_lens_host[:nd])
            plan = meta.backend_state.get("torch_decode_plan")
            if plan is None:  # the first layer of the step builds it for all the others
                plan = reference.make_decode_plan(meta.block_tables[:nd], meta.seq_lens[:nd],
                                                  max_decode_len, k_cache.shape[1], query.dtype)
                meta.backend_state["torch_decode_plan"] = plan
            out[:nd] = reference.paged_decode_attention(
                query[:nd], k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
                max_decode_len, scale, plan,
            )
        qsl = meta.query_start_loc_host
        for i in range(nd, meta.num_seqs):
            start, end, seq_len = qsl[i], qsl[i + 1], meta.seq_lens_host[i]
            if seq_len == end - start:  # no cached context: the fresh K/V are the sequence
                k, v = key[start:end], value[start:end]
            else:
                k = reference.gather_kv(k_cache, meta.block_tables[i], seq_len)
                v = reference.gather_kv(v_cache, meta.block_tables[i], seq_len)
            out[start:end] = reference.prefill_attention(query[start:end], k, v, scale)
        return out
