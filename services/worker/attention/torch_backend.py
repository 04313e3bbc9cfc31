"""The torch attention backend: the CPU path (and a fallback anywhere torch runs).

Decodes go through one batched call over gathered K/V; each prefill goes through SDPA,
on the fresh K/V when it has no cached context and on K/V gathered from the cache when
it does (chunked prefill, prefix-cache hits); either way K/V are read as the cache holds
them (a bf16 cache under an fp32 model: rounded). ``CpuAttentionBackend`` runs both
through C++ kernels over the paged cache instead, no gather. Both honour a layer's
sliding window (only the window's keys are gathered or read) and soft cap.
"""

from __future__ import annotations

import torch

from kernels import cpu_decode, cpu_fused, cpu_prefill, reference
from services.worker.attention.base import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    # not capturable (supports_cuda_graphs False): the decode plan is sized from the host
    # lists and syncs, as does the reference cache write; the graph runner's padded path
    # still runs through it eagerly (its host lists are true then, padded rows included)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        self._write_kv_cache(key, value, k_cache, v_cache, meta)
        out = torch.empty_like(query)
        nd = meta.num_decodes
        if nd:
            self._decode(query[:nd], k_cache, v_cache, meta, scale, out[:nd], window, softcap)
        if nd < meta.num_seqs:
            self._prefill(query, key, value, k_cache, v_cache, meta, scale, out, window, softcap)
        return out

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, out: torch.Tensor, window: int | None,
                 softcap: float | None) -> None:
        """The prefills (the sequences after the decodes) into their rows of ``out``."""
        qsl = meta.query_start_loc_host
        for i in range(meta.num_decodes, meta.num_seqs):
            start, end, seq_len = qsl[i], qsl[i + 1], meta.seq_lens_host[i]
            context_len = seq_len - (end - start)
            # the first key any query sees: positions only matter relative to each other
            first = 0 if window is None else max(0, context_len - window + 1)
            if first >= context_len:  # the fresh K/V cover every key the queries see
                fresh = start + first - context_len
                # as the cache holds them (a bf16 cache under fp32: rounded), so a prompt
                # sees the keys its later chunks and decodes will read back
                k = key[fresh:end].to(k_cache.dtype)
                v = value[fresh:end].to(v_cache.dtype)
            else:
                k = reference.gather_kv(k_cache, meta.block_tables[i], seq_len)[first:]
                v = reference.gather_kv(v_cache, meta.block_tables[i], seq_len)[first:]
            out[start:end] = reference.prefill_attention(query[start:end], k, v, scale, window,
                                                         softcap)

    def _write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        reference.write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)

    def _decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor, window: int | None,
                softcap: float | None) -> None:
        """The decodes (the first ``len(query)`` sequences) into ``out``."""
        nd = query.shape[0]
        max_decode_len = max(meta.seq_lens_host[:nd])
        key = f"torch_decode_plan/{window}"  # one plan per window size (None: full)
        plan = meta.backend_state.get(key)
        if plan is None:  # the first layer of the step builds it for all the others
            plan = reference.make_decode_plan(meta.block_tables[:nd], meta.seq_lens[:nd],
                                              max_decode_len, k_cache.shape[1], query.dtype,
                                              window)
            meta.backend_state[key] = plan
        out.copy_(reference.paged_decode_attention(
            query, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens[:nd],
            max_decode_len, scale, plan, softcap=softcap,
        ))


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch backend with the C++ kernels: decodes through ``kernels/cpu_decode.py``
    (it reads each K/V row of the paged cache once, where the torch path first gathers
    the rows into a padded copy and then runs SDPA over it) and, where it built, all the
    prefills of a step in one call through ``kernels/cpu_prefill.py`` (over the paged
    cache, with or without cached context; SDPA per sequence runs at a third of its
    speed at prompt lengths)."""

    name = "cpu"

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 scale: float, out: torch.Tensor, window: int | None,
                 softcap: float | None) -> None:
        if not cpu_prefill.available():
            super()._prefill(query, key, value, k_cache, v_cache, meta, scale, out, window,
                             softcap)
            return
        nd = meta.num_decodes
        first = meta.query_start_loc_host[nd]  # the prefills' tokens follow the decodes'
        starts = meta.backend_state.get("cpu_prefill_starts")
        if starts is None:  # the first layer of the step shifts them for all the others
            starts = meta.query_start_loc[nd:] - first
            meta.backend_state["cpu_prefill_starts"] = starts
        cpu_prefill.paged_prefill_attention(
            query[first:], k_cache, v_cache, starts, meta.seq_lens[nd:],
            meta.block_tables[nd:], scale, out=out[first:], window=window, softcap=softcap,
        )

    def _write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        # one pass, no sync; into the rows' dtype, or bf16 under fp32
        if k_cache.dtype in (key.dtype, torch.bfloat16) and cpu_fused.available():
            cpu_fused.write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        else:
            super()._write_kv_cache(key, value, k_cache, v_cache, meta)

    def _decode(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, out: torch.Tensor, window: int | None,
                softcap: float | None) -> None:
        nd = query.shape[0]
        cpu_decode.paged_decode_attention(query, k_cache, v_cache, meta.block_tables[:nd],
                                          meta.seq_lens[:nd], scale, out=out, window=window,
                                          softcap=softcap)
