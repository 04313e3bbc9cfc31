"""The model's shape and options, read from an HF directory's config.json.

Only what our model code needs, checked at load time so an unsupported model fails
with a message that names the problem instead of deep inside a forward pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared import model_limits
from shared.model_limits import rope_parameters

# rope_scaling types the model code computes as HF does (layers/rotary.py)
SCALED_ROPE_TYPES = ("linear", "llama3", "yarn", "dynamic", "longrope")

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
)
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate: SwiGLU, GeGLU (tanh GELU)


class ModelLoadError(RuntimeError):
    """The model directory is missing a file or describes a model we do not support."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before rotary
    partial_rotary_factor: float = 1.0  # Phi-4-mini: the rotated fraction of each head
    # per layer: the sliding window (a query sees the last `window` positions, itself
    # included) or None for full attention (shared/model_limits.layer_windows)
    layer_windows: tuple[int | None, ...] = ()
    # Gemma 2 / 3 hooks
    hidden_act: str = "silu"  # one of ACTIVATIONS
    embed_scale: bool = False  # embeddings times sqrt(hidden_size), in the model's dtype
    norm_unit_offset: bool = False  # every RMSNorm scales by (1 + weight), in fp32
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too (4 per layer)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5, not head_dim's
    attn_logit_softcapping: float | None = None  # scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # logits -> cap * tanh(logits / cap)
    rope_local_theta: float | None = None  # Gemma 3: the sliding layers' own (unscaled) rope
    # config.json as read: transformers' rope functions take the whole config
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"{path}: missing config.json (is this an HF model directory?)")
        cfg = json.loads(path.read_text())
        gen_path = Path(model_dir) / "generation_config.json"
        gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
        return cls.from_hf_dict(cfg, gen)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], gen: dict[str, Any] | None = None) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        gemma = arch in GEMMA
        act = ((cfg.get("hidden_activation") or "gelu_pytorch_tanh") if gemma
               else cfg.get("hidden_act", "silu"))
        if act != ("gelu_pytorch_tanh" if gemma else "silu"):
            raise ModelLoadError(f"unsupported hidden activation {act!r} for {arch}")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # transformers 5 writes rope_parameters; older configs rope_theta + rope_scaling
        rope_theta = float(_rope_params(cfg, model_limits.FULL).get(
            "rope_theta", cfg.get("rope_theta", 1e6 if arch == "Gemma3ForCausalLM" else 10000.0)))
        rope_scaling = rope_parameters(cfg) or None
        if rope_scaling is not None and rope_scaling["rope_type"] not in SCALED_ROPE_TYPES:
            raise ModelLoadError(f"rope_scaling: unsupported rope type "
                                 f"{rope_scaling['rope_type']!r} "
                                 f"(supported: default, {', '.join(SCALED_ROPE_TYPES)})")
        attention_bias = bool(cfg.get("attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        is_qwen3 = arch == "Qwen3ForCausalLM"
        layers = int(cfg["num_hidden_layers"])
        try:
            windows = tuple(model_limits.layer_windows(cfg))
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        if len(windows) != layers:
            raise ModelLoadError(f"layer_types names {len(windows)} layers, num_hidden_layers "
                                 f"is {layers}")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_proj_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            eos_token_ids=_eos_ids(cfg, gen or {}),
            bos_token_id=cfg.get("bos_token_id"),
            qk_norm=is_qwen3 or arch == "Gemma3ForCausalLM",
            partial_rotary_factor=float(_rope_params(cfg, model_limits.FULL).get(
                "partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))),
            layer_windows=windows,
            hf_config=dict(cfg),
            **(_gemma_fields(arch, cfg) if gemma else {}),
        )


def _rope_params(cfg: dict[str, Any], layer_type: str) -> dict[str, Any]:
    """config.json's rope_parameters (transformers 5), those of ``layer_type`` where they
    are nested by layer type (Gemma 3); empty when absent (older configs)."""
    params = cfg.get("rope_parameters") or {}
    if isinstance(params.get(model_limits.FULL), dict) or isinstance(
            params.get(model_limits.SLIDING), dict):
        return params.get(layer_type) or {}
    return params


def _gemma_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The hooks of Gemma 2 / Gemma 3 (text), with transformers' defaults for absent keys."""
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention: only causal attention is supported")
    fields: dict[str, Any] = {
        "hidden_act": "gelu_pytorch_tanh", "embed_scale": True, "norm_unit_offset": True,
        "sandwich_norms": True,
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
    }
    if arch == "Gemma2ForCausalLM":  # Gemma2Config's defaults: 50 and 30
        fields["attn_logit_softcapping"] = _optional_float(cfg.get("attn_logit_softcapping", 50.0))
        fields["final_logit_softcapping"] = _optional_float(
            cfg.get("final_logit_softcapping", 30.0))
        return fields
    # Gemma 3: HF's attention ignores attn_logit_softcapping, so it is not read here
    fields["final_logit_softcapping"] = _optional_float(cfg.get("final_logit_softcapping"))
    local = _rope_params(cfg, model_limits.SLIDING)
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ModelLoadError(f"rope_parameters.sliding_attention: unsupported rope type "
                             f"{local.get('rope_type', local.get('type'))!r} (only default)")
    fields["rope_local_theta"] = float(
        local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
    return fields


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _eos_ids(cfg: dict[str, Any], gen: dict[str, Any]) -> tuple[int, ...]:
    eos = gen.get("eos_token_id", cfg.get("eos_token_id"))
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
