"""Rotary position embeddings (rotate-half layout, as HF Llama), with rope scaling.

Scaled frequencies come from transformers' own rope initialisation functions
(``ROPE_INIT_FUNCTIONS``: ``linear``, ``llama3``, ``yarn``, ``dynamic``, ``longrope``),
so they are HF's by construction, with HF's ``attention_factor`` applied to cos and
sin. ``dynamic`` and ``longrope`` change frequencies with the sequence length in HF;
below ``original_max_position_embeddings`` both are the initial ones, and
``shared/model_limits.py`` keeps every sequence there. Any other type is refused at load.
On the CPU in fp32 / bf16 the rotation runs as one C++ kernel (``kernels.cpu_fused``,
same rounding) where that extension builds; ``fused=False`` keeps the torch ops.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kernels import cpu_fused
from services.worker.model_config import SCALED_ROPE_TYPES


def rope_type_of(scaling: dict[str, Any] | None) -> str:
    return str((scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))


def rope_inv_freq(
    head_dim: int, base: float, scaling: dict[str, Any] | None,
    hf_config: dict[str, Any] | None = None, max_position: int | None = None,
) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2], attention_factor) as transformers computes them.

    ``hf_config`` is the model's config.json; without one (kernel tests, a bare module) a
    Llama config with just these rope parameters stands in."""
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponents), 1.0
    if rope_type not in SCALED_ROPE_TYPES:
        raise ValueError(f"rope_scaling: unsupported rope type {rope_type!r} "
                         f"(supported: default, {', '.join(SCALED_ROPE_TYPES)})")
    if not hf_config:
        hf_config = {"model_type": "llama", "head_dim": head_dim, "hidden_size": head_dim,
                     "num_attention_heads": 1, "max_position_embeddings": max_position or 2048,
                     "rope_parameters": {**(scaling or {}), "rope_theta": base}}
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    fields = {k: v for k, v in hf_config.items() if k != "model_type"}
    config = AutoConfig.for_model(hf_config["model_type"], **fields)
    # transformers 5 nests Gemma 3's parameters by layer type: the scaled rope is the
    # full-attention layers' (the sliding ones' is unscaled, never computed here)
    params = getattr(config, "rope_parameters", None)
    layer_type = "full_attention" if isinstance(params, dict) and isinstance(
        params.get("full_attention"), dict) else None
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"),
                                                                layer_type=layer_type)
    return inv_freq.float(), float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None,
        fused: bool = True, hf_config: dict[str, Any] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.base, self.scaling = head_dim, max_position, base, scaling
        self.hf_config = hf_config
        # partial rotary (Phi-4-mini): only the first rotary_dim dims of a head rotate
        self.rotary_dim = rotary_dim or head_dim
        self.fused = fused and self.rotary_dim == head_dim  # the C++ kernel rotates whole heads
        half = self.rotary_dim // 2
        # [max_position, rotary_dim // 2] each
        self.register_buffer("cos_cache", torch.empty(max_position, half), persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_position, half), persistent=False)
        if self.cos_cache.device.type != "meta":
            self.fill_cache()

    @torch.no_grad()
    def fill_cache(self) -> None:
        device = self.cos_cache.device
        inv_freq, attention_factor = rope_inv_freq(self.rotary_dim, self.base, self.scaling,
                                                   self.hf_config, self.max_position)
        positions = torch.arange(self.max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq.to(device))
        self.cos_cache.copy_(freqs.cos() * attention_factor)
        self.sin_cache.copy_(freqs.sin() * attention_factor)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # new contiguous tensors, shaped as the inputs
        if (
            self.fused and query.is_cpu and query.dtype in cpu_fused.DTYPES
            and key.dtype == query.dtype and self.cos_cache.dtype == torch.float32
            and cpu_fused.available()
        ):  # reads the q / k slices of the qkv projection in place
            return cpu_fused.rotary(query, key, positions, self.cos_cache, self.sin_cache)
        cos = self.cos_cache.index_select(0, positions)[:, None, :]  # [T, 1, R/2]
        sin = self.sin_cache.index_select(0, positions)[:, None, :]
        if self.rotary_dim < self.head_dim:
            r = self.rotary_dim
            return (torch.cat((_rotate(query[..., :r], cos, sin), query[..., r:]), dim=-1),
                    torch.cat((_rotate(key[..., :r], cos, sin), key[..., r:]), dim=-1))
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
