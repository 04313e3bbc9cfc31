"""Which CPU steps run all their decoder layers in one C++ call, and with what.

A decode step on the CPU spends, at batch 1, about a fifth of its time in Python between
the kernels (~20 op calls a layer). ``kernels.cpu_decoder.decode_layers`` runs the same
kernels in the same order from C++, bit-identical to the Python loop. ``CpuDecoderPath``
gathers once what it needs from a model whose every layer it covers:

- the CPU kernels of the Python path: ``cpu_fused`` norms (no unit offset), the C++
  rotary (whole heads, fp32 tables) and KV-cache write, and every layer's linears on one
  kernel: ``cpu_gemm`` packed linears (qkv, o, down) and the SwiGLU ``linear_silu``
  (gate_up packed gated); or, where ``layers/linear.py`` packs for oneDNN (bf16 on an AMX
  CPU), oneDNN's linears, ``cpu_gemv`` at up to ``GEMV_MAX_ROWS`` bf16 rows and
  ``cpu_fused.silu_mul`` after gate_up, as ``linear()`` and the MLP run them; no GeGLU;
- plain pre-norm layers (no sandwich norms; Qwen3's per-head q/k norms, with the layer
  norms' eps), one rotary for all layers, full attention without soft cap, one rank.

``LlamaForCausalLM.forward`` then takes it for a step on the ``cpu`` attention backend
(decodes through ``cpu_decode``, prefill chunks through ``cpu_prefill``, as that backend
splits them) with no per-step rope plan, its KV cache in the activations' dtype; every
other step, and every other model, runs the Python loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels import cpu_decoder, cpu_fused, cpu_gemv
from kernels.cpu_decoder import LayerDims, LayerWeights
from services.worker.attention.base import AttentionBackend, AttentionMetadata
from services.worker.layers.linear import GEMV_MAX_ROWS, PackedWeight
from services.worker.layers.norm import RMSNorm
from services.worker.layers.rotary import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]  # as models/llama.py's (which imports this)


def _packed(packed: PackedWeight | None, gemm: bool, silu_gated: bool) -> PackedWeight | None:
    """The packed weight if its kernel is the one asked (cpu_gemm, gated as asked; or
    oneDNN), else None."""
    if packed is None or packed.gemm != gemm or packed.silu_gated != (gemm and silu_gated):
        return None
    return packed


def _plain_norm(norm: RMSNorm, dtype: torch.dtype) -> bool:
    return norm.fused and not norm.unit_offset and norm.weight.dtype == dtype


@dataclass(frozen=True)
class CpuDecoderPath:
    weights: LayerWeights
    dims: LayerDims
    eps: float
    scale: float
    rotary: RotaryEmbedding
    dtype: torch.dtype

    @classmethod
    def build(cls, model: nn.Module) -> CpuDecoderPath | None:
        """The path for this model (a ``models.llama.LlamaForCausalLM``), or None where a
        layer is one it does not cover (or the extensions did not build)."""
        dtype = model.embed_tokens.weight.dtype
        rotary = model.rotary
        if (model.tp.size != 1 or model.embed_tokens.weight.device.type != "cpu"
                or dtype not in cpu_fused.DTYPES or not rotary.fused
                or rotary.rotary_dim != rotary.head_dim
                or rotary.cos_cache.dtype != torch.float32 or not cpu_decoder.available()):
            return None
        lists: dict[str, list] = {}  # LayerWeights' per-layer lists, as the loop names them
        plain: list[torch.Tensor] = []
        shapes, eps, scales = set(), set(), set()
        # every layer's linears on one kernel: cpu_gemm, or oneDNN (bf16 on an AMX CPU)
        first = model.layers[0].self_attn.qkv_weight_packed if len(model.layers) else None
        gemm = first is None or first.gemm
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv = _packed(attn.qkv_weight_packed, gemm, False)
            o = _packed(attn.o_weight_packed, gemm, False)
            gate_up = _packed(mlp.gate_up_weight_packed, gemm, True)
            down = _packed(mlp.down_weight_packed, gemm, False)
            qk_norms = (attn.q_norm, attn.k_norm)
            if (qkv is None or o is None or gate_up is None or down is None
                    or layer.sandwich_norms
                    or (qk_norms[0] is None) != (qk_norms[1] is None)
                    or any(n is not None and not _plain_norm(n, dtype) for n in qk_norms)
                    or attn.window is not None or attn.softcap is not None
                    or attn.rotary is not rotary or mlp.gelu
                    or (not gemm and not (mlp.fused and cpu_fused.available()))
                    or not _plain_norm(layer.input_layernorm, dtype)
                    or not _plain_norm(layer.post_attention_layernorm, dtype)):
                return None
            shapes.add((attn.num_heads, attn.num_kv_heads, attn.head_dim, qkv.out_features,
                        o.out_features, gate_up.out_features, down.out_features))
            eps.update((layer.input_layernorm.eps, layer.post_attention_layernorm.eps))
            eps.update(n.eps for n in qk_norms if n is not None)
            scales.add(attn.scale)
            for name, value in (
                ("input_norm", layer.input_layernorm.weight),
                ("post_norm", layer.post_attention_layernorm.weight),
                ("qkv", qkv.data), ("qkv_bias", attn.qkv_bias),
                ("q_norm", None if attn.q_norm is None else attn.q_norm.weight),
                ("k_norm", None if attn.k_norm is None else attn.k_norm.weight),
                ("o", o.data),
                ("o_bias", attn.o_bias), ("gate_up", gate_up.data),
                ("gate_up_bias", mlp.gate_up_bias), ("down", down.data),
                ("down_bias", mlp.down_bias),
            ):
                lists.setdefault(name, []).append(value)
            if not gemm:  # cpu_gemv runs a few rows on the plain weights (layers/linear.py)
                plain += [attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight]
        if len(shapes) != 1 or len(eps) != 1 or len(scales) != 1:
            return None
        if not gemm and not all(w.is_contiguous() for w in plain):
            return None
        gemv_rows = (GEMV_MAX_ROWS if not gemm and dtype == torch.bfloat16
                     and cpu_gemv.available() else 0)
        weights = LayerWeights(**lists, onednn_plain=plain, gemv_max_rows=gemv_rows)
        return cls(weights, LayerDims(*shapes.pop()), eps.pop(), scales.pop(), rotary, dtype)

    def takes(self, meta: AttentionMetadata, backend: AttentionBackend,
              kv_caches: list[KVCache], rope_plan: object) -> bool:
        """Whether this step runs through ``run``."""
        return (backend.name == "cpu" and rope_plan is None
                and kv_caches[0][0].dtype in (self.dtype, torch.bfloat16))

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
            meta: AttentionMetadata, output_rows: torch.Tensor | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual stream), as the Python loop leaves them;
        ``output_rows``: only those rows, as the loop's with the same rows."""
        nd, first, starts = meta.num_decodes, 0, None
        if nd < meta.num_seqs:  # the prefill chunks follow the decodes, as in the backend
            first = meta.query_start_loc_host[nd]
            starts = meta.query_start_loc[nd:] - first
        return cpu_decoder.decode_layers(
            hidden, positions, self.weights, self.dims, [k for k, _ in kv_caches],
            [v for _, v in kv_caches], self.rotary.cos_cache, self.rotary.sin_cache,
            meta.slot_mapping, meta.block_tables, meta.seq_lens, self.eps, self.scale,
            num_decodes=nd, prefill_first=first, prefill_starts=starts,
            output_rows=output_rows)
