"""Tiny random HF checkpoints (Llama, Qwen2, Qwen3, Mistral, Phi-3, Gemma 2, Gemma 3)
written to disk for tests.

Weights are drawn with a larger spread than HF's default init so that logits are
well separated and greedy decoding is not decided by float rounding. The Gemma kinds
have a 6-token sliding window on every other layer and small soft caps, so that prompts
of a few dozen tokens exercise both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

GEMMA = {  # overrides of the tiny shape for the Gemma kinds
    "num_hidden_layers": 4, "head_dim": 16, "sliding_window": 6,
    "query_pre_attn_scalar": 24,  # not head_dim: the attention scale must come from it
    "final_logit_softcapping": 4.0, "pad_token_id": 0,
}


def _spread_init(model: torch.nn.Module, seed: int, norm_center: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # Gemma's norms scale by 1 + weight: centred on 0 there
                p.copy_(norm_center + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)


def make_checkpoint(path: Path, kind: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Writes a tiny random model of `kind` (llama, qwen2, qwen3, mistral, phi3, gemma2,
    gemma3) to `path`."""
    common: dict[str, Any] = {
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    if kind == "gemma2":
        common.update(GEMMA, attn_logit_softcapping=3.0)
    elif kind == "gemma3":  # every 2nd layer full; a linear-scaled global rope, a local one
        common.update(GEMMA, sliding_window_pattern=2, rope_theta=10000.0,
                      rope_local_base_freq=100.0,
                      rope_scaling={"rope_type": "linear", "factor": 2.0})
    common.update(overrides)
    if kind == "llama":
        config = LlamaConfig(**common)
    elif kind == "qwen2":
        common.setdefault("tie_word_embeddings", True)
        config = Qwen2Config(**common)
    elif kind == "qwen3":
        common.setdefault("head_dim", 32)  # Qwen3 decouples head_dim from hidden / heads
        config = Qwen3Config(**common)
    elif kind == "mistral":
        config = MistralConfig(**common)
    elif kind == "phi3":
        common.setdefault("pad_token_id", 0)  # Phi3Config's default pad id is outside the vocab
        config = Phi3Config(**common)
    elif kind == "gemma2":  # layers 0, 2 windowed (HF's default alternation)
        config = Gemma2Config(**common)
    elif kind == "gemma3":
        config = Gemma3TextConfig(**common)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _spread_init(model, seed, norm_center=0.0 if kind.startswith("gemma") else 1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf(path: Path) -> torch.nn.Module:
    """The checkpoint in HF transformers, float32, eager attention (the one that applies
    Gemma 2's attention soft cap; the same math as SDPA for the other families)."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation="eager").eval()
