"""Rotary position embeddings (rotate-half layout, as HF Llama), with rope scaling.

Supported ``rope_scaling`` types: default, ``linear`` (positions divided by the
factor) and ``llama3`` (wavelength-dependent frequency scaling of Llama 3.1+).
On the CPU in fp32 / bf16 the rotation runs as one C++ kernel (``kernels.cpu_fused``,
same rounding) where that extension builds; ``fused=False`` keeps the torch ops.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kernels import cpu_fused


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are scaled by the factor, short ones kept, the band between blended
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def rope_inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    assert scaling is not None
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_position: int, base: float, scaling: dict[str, Any] | None,
        fused: bool = True,
    ) -> None:
        super().__init__()
        self.head_dim, self.max_position, self.base, self.scaling = head_dim, max_position, base, scaling
        self.fused = fused
        # [max_position, head_dim // 2] each
        self.register_buffer("cos_cache", torch.empty(max_position, head_dim // 2), persistent=False)
        self.register_buffer("sin_cache", torch.empty(max_position, head_dim // 2), persistent=False)
        if self.cos_cache.device.type != "meta":
            self.fill_cache()

    @torch.no_grad()
    def fill_cache(self) -> None:
        device = self.cos_cache.device
        inv_freq = rope_inv_freq(self.head_dim, self.base, self.scaling).to(device)
        positions = torch.arange(self.max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq)
        self.cos_cache.copy_(freqs.cos())
        self.sin_cache.copy_(freqs.sin())

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
        cos = self.cos_cache.index_select(0, positions)[:, None, :]  # [T, 1, D/2]
        sin = self.sin_cache.index_select(0, positions)[:, None, :]
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)
