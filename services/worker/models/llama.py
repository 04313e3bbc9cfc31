"""The Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3/4, SmolLM, Gemma 2, Gemma 3
text) over a flattened varlen batch.

All new tokens of a step are concatenated into one ``[num_tokens]`` batch with their
``positions``; per-sequence structure lives in the ``AttentionMetadata``. The q/k/v
and gate/up projections are fused into one matmul each (weights concatenated at load
time by the loader). Logits are computed only for the rows the caller asks for.

The families differ only through ``ModelConfig`` fields read here: biases, q/k norms,
partial rotary, per-layer sliding windows, and Gemma's hooks (embeddings scaled by
sqrt(hidden_size), RMSNorm by 1 + weight, GeGLU, norms on the attention and MLP outputs
too, query_pre_attn_scalar, attention and final logit soft caps, a second rope for
Gemma 3's sliding layers).

Tensor parallelism (``services/worker/parallel.py``): with a group of M ranks each
attention layer holds its ranks' heads (and KV heads, replicated when ranks outnumber
them), each MLP its columns, the embedding and lm_head their vocabulary rows; the o and
down projections' partial sums are all-reduced (their biases added once, after), and
the logits are gathered over the vocabulary. With one rank nothing of that runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu_fused
from services.worker.attention.base import AttentionBackend, AttentionMetadata
from services.worker.layers.embedding import VocabEmbedding
from services.worker.layers.fused_path import use_triton
from services.worker.layers.linear import PackedWeight, linear, linear_silu
from services.worker.layers.norm import RMSNorm
from services.worker.layers.rotary import RopePlan, RotaryEmbedding
from services.worker.layers.screened_argmax import ScreenedArgmax
from services.worker.model_config import ModelConfig
from services.worker.models.cpu_decoder_path import CpuDecoderPath
from services.worker.parallel import SINGLE, ShardSizes, TensorParallel, shard_sizes

KVCache = tuple[torch.Tensor, torch.Tensor]  # per layer: k, v [blocks, block_size, kv_heads, D]


def _weight(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _norm(config: ModelConfig, size: int) -> RMSNorm:
    return RMSNorm(size, config.rms_norm_eps, unit_offset=config.norm_unit_offset)


class LlamaAttention(nn.Module):
    PACKED_WEIGHTS = ("qkv_weight", "o_weight")  # see layers/linear.py

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding,
                 window: int | None = None, shard: ShardSizes | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.qkv_weight_packed: PackedWeight | None = None
        self.o_weight_packed: PackedWeight | None = None
        self.tp = tp
        self.num_heads = config.num_attention_heads if shard is None else shard.num_heads
        self.num_kv_heads = config.num_key_value_heads if shard is None else shard.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.window = window  # this layer's sliding window, None: full attention
        self.softcap = config.attn_logit_softcapping
        self.rotary = rotary
        self.qkv_weight = _weight(self.q_size + 2 * self.kv_size, config.hidden_size)
        self.qkv_bias = _weight(self.q_size + 2 * self.kv_size) if config.qkv_bias else None
        self.o_weight = _weight(config.hidden_size, self.q_size)
        self.o_bias = _weight(config.hidden_size) if config.o_proj_bias else None
        # Qwen3, Gemma 3: per-head RMSNorm of q and k (over head_dim) before the rotation
        self.q_norm = _norm(config, self.head_dim) if config.qk_norm else None
        self.k_norm = _norm(config, self.head_dim) if config.qk_norm else None

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, hidden]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rope_plan: RopePlan | None = None,
    ) -> torch.Tensor:  # [T, hidden]
        qkv = linear(hidden, self.qkv_weight, self.qkv_bias, self.qkv_weight_packed)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = hidden.shape[0]
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(t * self.num_heads, self.head_dim))[0]
            k = self.k_norm(k.reshape(t * self.num_kv_heads, self.head_dim))[0]
        q, k = self.rotary(
            positions,
            q.reshape(t, self.num_heads, self.head_dim),
            k.reshape(t, self.num_kv_heads, self.head_dim),
            rope_plan,
        )
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                              window=self.window, softcap=self.softcap)
        return _row_parallel(out.reshape(t, self.q_size), self.o_weight, self.o_bias,
                             self.o_weight_packed, self.tp)


class LlamaMLP(nn.Module):
    PACKED_WEIGHTS = ("gate_up_weight", "down_weight")

    def __init__(self, config: ModelConfig, fused: bool = True, shard: ShardSizes | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.fused = fused  # Triton on CUDA, kernels.cpu_fused.silu_mul where it applies
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"  # GeGLU (Gemma), else SwiGLU
        # a CPU SwiGLU may pack gate_up for linear_silu (layers/linear.py)
        self.silu_gated_weights = () if self.gelu or not fused else ("gate_up_weight",)
        self.gate_up_weight_packed: PackedWeight | None = None
        self.down_weight_packed: PackedWeight | None = None
        self.tp = tp
        self.intermediate_size = config.intermediate_size if shard is None else shard.intermediate
        self.gate_up_weight = _weight(2 * self.intermediate_size, config.hidden_size)
        self.gate_up_bias = _weight(2 * self.intermediate_size) if config.mlp_bias else None
        self.down_weight = _weight(config.hidden_size, self.intermediate_size)
        self.down_bias = _weight(config.hidden_size) if config.mlp_bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        packed = self.gate_up_weight_packed
        if packed is not None and packed.silu_gated:  # one C++ call, silu_mul's rounding
            act = linear_silu(x, packed, self.gate_up_bias)
            return _row_parallel(act, self.down_weight, self.down_bias,
                                 self.down_weight_packed, self.tp)
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias, packed)
        if use_triton(self.fused, gate_up.device, gate_up.dtype):
            from kernels import fused_activation  # at first use: see layers/fused_path.py

            act = fused_activation.act_mul(gate_up, gelu=self.gelu)  # one launch
        elif self.gelu:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
        elif (
            self.fused and gate_up.is_cpu and gate_up.dtype in cpu_fused.DTYPES
            and cpu_fused.available()
        ):
            act = cpu_fused.silu_mul(gate_up)  # one C++ pass, the same rounding
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = F.silu(gate) * up
        return _row_parallel(act, self.down_weight, self.down_bias, self.down_weight_packed,
                             self.tp)


def _row_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  packed: PackedWeight | None, tp: TensorParallel) -> torch.Tensor:
    """A row-parallel linear: each rank's partial product, summed over the group; the
    bias (held whole on every rank) added once, after the sum."""
    if tp.size == 1:
        return linear(x, weight, bias, packed)
    out = tp.all_reduce(linear(x, weight, None, packed))
    return out if bias is None else out + bias


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding,
                 window: int | None = None, shard: ShardSizes | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.input_layernorm = _norm(config, config.hidden_size)
        self.self_attn = LlamaAttention(config, rotary, window, shard, tp)
        # Llama: the MLP's pre-norm; Gemma (sandwich_norms): the attention output's norm
        self.post_attention_layernorm = _norm(config, config.hidden_size)
        self.sandwich_norms = config.sandwich_norms
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = _norm(config, config.hidden_size)
            self.post_feedforward_layernorm = _norm(config, config.hidden_size)
        self.mlp = LlamaMLP(config, shard=shard, tp=tp)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rope_plan: RopePlan | None = None,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden, residual) in and out: the residual stream is their sum.
        ``output_rows``: only those rows of both come out (every token's K/V is written;
        the MLP runs for those rows alone)."""
        hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, kv_cache, meta, backend, rope_plan)
        if output_rows is not None:
            hidden = hidden.index_select(0, output_rows)
            residual = residual.index_select(0, output_rows)
        if not self.sandwich_norms:
            hidden, residual = self.post_attention_layernorm(hidden, residual)
            return self.mlp(hidden), residual
        hidden = self.post_attention_layernorm(hidden)[0]
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden))[0], residual


class LlamaForCausalLM(nn.Module):
    PACKED_WEIGHTS = ("lm_head_weight",)

    def __init__(self, config: ModelConfig, max_position: int | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.lm_head_weight_packed: PackedWeight | None = None
        self.config = config
        self.tp = tp
        # this rank's share of the split sizes (the whole model with one rank)
        self.shard = shard_sizes(config.num_attention_heads, config.num_key_value_heads,
                                 config.intermediate_size, config.vocab_size, tp)
        max_position = max_position or config.max_position_embeddings
        rotary_dim = int(config.head_dim * config.partial_rotary_factor)
        rotary = RotaryEmbedding(
            config.head_dim, max_position, config.rope_theta, config.rope_scaling,
            hf_config=config.hf_config, rotary_dim=rotary_dim,
        )
        # Gemma 3: the sliding layers rotate with their own base, unscaled
        local = rotary if config.rope_local_theta is None else RotaryEmbedding(
            config.head_dim, max_position, config.rope_local_theta, None, rotary_dim=rotary_dim)
        windows = config.layer_windows or (None,) * config.num_hidden_layers
        shard = self.shard
        self.embed_tokens = VocabEmbedding(
            config.vocab_size if tp.size == 1 else shard.vocab_per_rank, config.hidden_size,
            shard.vocab_start, tp)
        self.embed_scale: float | None = None  # Gemma: sqrt(hidden) in the weights' dtype
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, rotary if window is None else local, window, shard, tp)
            for window in windows
        )
        self.norm = _norm(config, config.hidden_size)
        # tied embeddings share the embedding tensor (set by the loader)
        self.lm_head_weight = _weight(self.embed_tokens.weight.shape[0], config.hidden_size)
        self.rotary = rotary
        # the CPU decode steps' one-call path, once enable_cpu_decoder found it covers
        # every layer (None: every step runs the Python loop)
        self.cpu_decoder_path: CpuDecoderPath | None = None
        # greedy CPU steps' tokens without the whole fp32 LM head, once
        # enable_screened_argmax found it applies (None: the full head)
        self.screened_argmax: ScreenedArgmax | None = None

    def enable_cpu_decoder(self) -> bool:
        """Send CPU decode steps through ``cpu_decoder_path.py`` where it covers this model
        (call after the CPU linears are packed); returns whether it does."""
        self.cpu_decoder_path = CpuDecoderPath.build(self)
        return self.cpu_decoder_path is not None

    def enable_screened_argmax(self) -> bool:
        """Take plain greedy CPU steps' tokens through ``layers/screened_argmax.py`` where
        it applies (an fp32 head packed for cpu_gemm on a CPU with AVX512-BF16, one rank,
        no final soft cap: its rounding could tie logits the head keeps apart); call after
        the CPU linears are packed. Returns whether it does."""
        self.screened_argmax = None
        if self.tp.size == 1 and self.config.final_logit_softcapping is None:
            self.screened_argmax = ScreenedArgmax.build(self.lm_head_weight,
                                                        self.lm_head_weight_packed)
        return self.screened_argmax is not None

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Derived state, once the weights are in place: the rotary tables (their buffers
        come out of ``to_empty`` uninitialised), Gemma's norm scales and embedding scale."""
        for module in self.modules():  # shared modules (a rotary) once
            if isinstance(module, RotaryEmbedding):
                module.fill_cache()
            elif isinstance(module, RMSNorm):
                module.finish_loading()
        if self.config.embed_scale:  # HF rounds sqrt(hidden) to the weights' dtype
            scale = torch.tensor(self.config.hidden_size**0.5, dtype=torch.float32)
            self.embed_scale = float(scale.to(self.embed_tokens.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
        backend: AttentionBackend,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, hidden] final hidden states ([R, hidden]: output_rows')
        """``output_rows`` ([R] int64, e.g. the rows whose logits a step samples): only
        those rows' final hidden states, in that order; the last layer runs its MLP for
        them alone (the other tokens of a prefill need only their K/V), as they would
        come out of the whole forward."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        residual: torch.Tensor | None = None
        # dynamic / longrope: this step's length-dependent rotation, once for every layer
        # (None for static rope types); each layer's rotary uses it only if it owns it
        rope_plan = self.rotary.plan(positions, meta)
        fast = self.cpu_decoder_path
        if fast is not None and fast.takes(meta, backend, kv_caches, rope_plan):
            hidden, residual = fast.run(hidden, positions, kv_caches, meta, output_rows)
        else:
            last = len(self.layers) - 1
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                hidden, residual = layer(positions, hidden, residual, kv_cache, meta, backend,
                                         rope_plan, output_rows if i == last else None)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(  # [N, hidden] -> [N, vocab] fp32 (or the model's dtype)
        self, hidden: torch.Tensor, out: torch.Tensor | None = None, *, fp32: bool = True,
    ) -> torch.Tensor:
        """``out``: an [N, vocab] fp32 tensor to write them into (a decode graph's
        persistent output) instead of a new one. ``fp32=False``: the LM head's output as it
        is, for the sampler, which widens them itself where it needs fp32 (the same values:
        widening is exact) and takes a greedy step's argmax without the copy; a soft-capped
        model's are fp32 either way."""
        logits = linear(hidden, self.lm_head_weight, None, self.lm_head_weight_packed)
        if self.tp.size > 1:  # each rank's vocabulary rows, then the padding cut off
            logits = self.tp.all_gather_last(logits)[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcapping
        if out is None and not fp32 and cap is None:
            return logits
        # the fp32 copy (a new tensor, or out) is the one every later step works on
        logits = logits.float() if out is None else out.copy_(logits)
        if cap is not None:  # Gemma, in fp32 (HF: in the model's dtype)
            logits = logits.div_(cap).tanh_().mul_(cap)
        return logits
