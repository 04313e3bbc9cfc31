"""``ModelConfig``s built in memory for tests of one layer (no checkpoint on disk)."""

from __future__ import annotations

from services.worker.model_config import ModelConfig


def mlp_config(hidden_act: str = "silu", *, hidden_size: int = 48,
               intermediate_size: int = 80, mlp_bias: bool = False) -> ModelConfig:
    """A one-layer Llama config whose MLP is the point: SwiGLU (``silu``) or GeGLU
    (``gelu_pytorch_tanh``), the given sizes, with or without MLP biases."""
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=32, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=hidden_size // 2, rms_norm_eps=1e-6,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64,
        tie_word_embeddings=False, qkv_bias=False, o_proj_bias=False, mlp_bias=mlp_bias,
        eos_token_ids=(0,), bos_token_id=None, hidden_act=hidden_act)
