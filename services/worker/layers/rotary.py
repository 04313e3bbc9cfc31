"""Rotary position embeddings (rotate-half layout, as HF Llama), with rope scaling.

Scaled frequencies come from transformers' own rope initialisation functions
(``ROPE_INIT_FUNCTIONS``: ``linear``, ``llama3``, ``yarn``, ``dynamic``, ``longrope``),
so they are HF's by construction, with HF's ``attention_factor`` applied to cos and
sin. Any other type is refused at load.

``dynamic`` and ``longrope`` change the frequencies with the sequence length, as HF's
``dynamic_rope_update`` does on each forward call: with L the largest position in the
call plus one, ``longrope`` uses its long factors when L > ``original_max_position_
embeddings`` (its short ones otherwise) and ``dynamic`` recomputes its NTK base for L
when L > ``max_position_embeddings``. Here a step's call holds many sequences, so L is
each sequence's own (its length after the step): a sequence gets exactly what HF gives
it alone, with its prompt prefilled in the same chunks. Tokens already in the KV cache
keep the rotation they were written with, as in HF. ``plan`` works this out once per
step (None, and no cost, when no sequence is past the threshold).
On CUDA the rotation runs as one Triton kernel (``kernels.fused_rotary``, in place,
partial rotary and every rope type: it reads the rows of the tables the torch path
would), on the CPU in fp32 / bf16 as one C++ kernel (``kernels.cpu_fused``, whole heads
only) where that extension builds, both with the torch path's rounding; elsewhere, and
with ``fused=False``, the torch ops (``kernels.reference.rotary``). See ``fused_path.py``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels import cpu_fused, reference
from services.worker.attention.base import AttentionMetadata
from services.worker.layers.fused_path import use_triton
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
    return HfRope(head_dim, base, scaling, hf_config, max_position).inv_freq()


class HfRope:
    """transformers' rope initialisation for one model: its config built once."""

    def __init__(self, head_dim: int, base: float, scaling: dict[str, Any] | None,
                 hf_config: dict[str, Any] | None = None, max_position: int | None = None) -> None:
        if not hf_config:
            hf_config = {"model_type": "llama", "head_dim": head_dim, "hidden_size": head_dim,
                         "num_attention_heads": 1, "max_position_embeddings": max_position or 2048,
                         "rope_parameters": {**(scaling or {}), "rope_theta": base}}
        from transformers import AutoConfig

        fields = {k: v for k, v in hf_config.items() if k != "model_type"}
        self.config = AutoConfig.for_model(hf_config["model_type"], **fields)
        self.rope_type = rope_type_of(scaling)
        # transformers 5 nests Gemma 3's parameters by layer type: the scaled rope is the
        # full-attention layers' (the sliding ones' is unscaled, never computed here)
        params = getattr(self.config, "rope_parameters", None)
        self.layer_type = "full_attention" if isinstance(params, dict) and isinstance(
            params.get("full_attention"), dict) else None
        scaling = scaling or {}
        # where HF switches to length-dependent frequencies (see the module docstring)
        self.threshold: int | None = None
        if self.rope_type == "longrope":
            self.threshold = int(scaling.get("original_max_position_embeddings") or getattr(
                self.config, "original_max_position_embeddings", None)
                or self.config.max_position_embeddings)
        elif self.rope_type == "dynamic":
            self.threshold = int(self.config.max_position_embeddings)

    def inv_freq(self, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
        """(inv_freq, attention_factor) for a sequence of ``seq_len`` (None: the initial)."""
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        extra = {} if seq_len is None else {"seq_len": seq_len}
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[self.rope_type](
            self.config, torch.device("cpu"), layer_type=self.layer_type, **extra)
        return inv_freq.float(), float(attention_factor)


@dataclass(frozen=True)
class RopePlan:
    """One step's rotation tables for a length-dependent rope: row ``index[t]`` of
    ``cos``/``sin`` rotates token t."""

    owner: RotaryEmbedding
    index: torch.Tensor  # [T] int64
    cos: torch.Tensor  # [rows, rotary_dim / 2]
    sin: torch.Tensor


class RotaryEmbedding(nn.Module):
    cos_cache: torch.Tensor  # buffers (registered in __init__)
    sin_cache: torch.Tensor

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
        self.fused = fused
        half = self.rotary_dim // 2
        self.rope_type = rope_type_of(scaling)
        self._hf: HfRope | None = None  # transformers' rope functions (scaled types)
        # [max_position, rotary_dim // 2] each; longrope: the short factors' rows, then as
        # many of the long factors' (plan indexes those at position + max_position)
        rows = max_position * (2 if self.rope_type == "longrope" else 1)
        self.register_buffer("cos_cache", torch.empty(rows, half), persistent=False)
        self.register_buffer("sin_cache", torch.empty(rows, half), persistent=False)
        if self.cos_cache.device.type != "meta":
            self.fill_cache()

    @property
    def length_dependent(self) -> bool:
        return self.rope_type in ("dynamic", "longrope")

    @property
    def plan_threshold(self) -> int | None:
        """The sequence length past which ``plan`` returns a per-step plan (a step with a
        longer sequence); None: never (static rope types)."""
        if not self.length_dependent or self._hf is None:
            return None
        return self._hf.threshold

    @torch.no_grad()
    def fill_cache(self) -> None:
        device = self.cos_cache.device
        if self.rope_type == "default":
            inv_freq, attention_factor = rope_inv_freq(self.rotary_dim, self.base, None)
        else:
            self._hf = HfRope(self.rotary_dim, self.base, self.scaling, self.hf_config,
                              self.max_position)
            inv_freq, attention_factor = self._hf.inv_freq()
        m = self.max_position
        positions = torch.arange(m, dtype=torch.float32, device=device)
        freqs = torch.outer(positions, inv_freq.to(device))
        self.cos_cache[:m].copy_(freqs.cos() * attention_factor)
        self.sin_cache[:m].copy_(freqs.sin() * attention_factor)
        if self.rope_type == "longrope":
            assert self._hf is not None and self._hf.threshold is not None
            long_freq, long_factor = self._hf.inv_freq(self._hf.threshold + 1)
            freqs = torch.outer(positions, long_freq.to(device))
            self.cos_cache[m:].copy_(freqs.cos() * long_factor)
            self.sin_cache[m:].copy_(freqs.sin() * long_factor)

    def plan(self, positions: torch.Tensor, meta: AttentionMetadata) -> RopePlan | None:
        """This step's tables where a sequence is past the rope's length threshold; None
        (the cached tables as they are) otherwise, and always for static rope types."""
        if not self.length_dependent or self._hf is None or self._hf.threshold is None:
            return None
        threshold = self._hf.threshold
        lens = meta.seq_lens_host
        if not lens or max(lens) <= threshold:
            return None
        starts = meta.query_start_loc_host
        device = positions.device
        if self.rope_type == "longrope":
            long = torch.tensor([n > threshold for n in lens], device=device)
            counts = torch.tensor([b - a for a, b in itertools.pairwise(starts)], device=device)
            offset = torch.repeat_interleave(long, counts).long() * self.max_position
            return RopePlan(self, positions + offset, self.cos_cache, self.sin_cache)
        # dynamic: a sequence past the threshold rotates its tokens with the NTK base of
        # its own length, computed here (one small rope init per such sequence)
        cos = self.cos_cache.index_select(0, positions.clamp(max=self.max_position - 1))
        sin = self.sin_cache.index_select(0, positions.clamp(max=self.max_position - 1))
        for i, n in enumerate(lens):
            if n <= threshold:
                continue
            inv_freq, factor = self._hf.inv_freq(n)
            rows = slice(starts[i], starts[i + 1])
            freqs = torch.outer(positions[rows].float(), inv_freq.to(device))
            cos[rows] = freqs.cos() * factor
            sin[rows] = freqs.sin() * factor
        index = torch.arange(positions.shape[0], device=device)
        return RopePlan(self, index, cos, sin)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens] int64
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        plan: RopePlan | None = None,  # this step's length-dependent tables (``plan``)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # shaped as the inputs
        """The rotated query and key: on the Triton path query and key themselves, rotated
        in place (the q / k views of the qkv projection); elsewhere new contiguous tensors."""
        index, cos_table, sin_table = positions, self.cos_cache, self.sin_cache
        if plan is not None and plan.owner is self:
            index, cos_table, sin_table = plan.index, plan.cos, plan.sin
        if (
            use_triton(self.fused, query.device, query.dtype) and key.dtype == query.dtype
            and query.stride(-1) == 1 and key.stride(-1) == 1
            and cos_table.is_floating_point()
        ):
            from kernels import fused_rotary  # at first use: see fused_path.py

            fused_rotary.rotary_inplace(query, key, index, cos_table, sin_table)
            return query, key
        if (  # the C++ kernel rotates whole heads
            self.fused and self.rotary_dim == self.head_dim
            and query.is_cpu and query.dtype in cpu_fused.DTYPES
            and key.dtype == query.dtype and cos_table.dtype == torch.float32
            and cpu_fused.available()
        ):  # reads the q / k slices of the qkv projection in place
            return cpu_fused.rotary(query, key, index, cos_table, sin_table)
        return reference.rotary(query, key, index, cos_table, sin_table)
