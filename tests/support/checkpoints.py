"""Tiny random HF checkpoints (Llama, Qwen2, Qwen3, Mistral) written to disk for tests.

Weights are drawn with a larger spread than HF's default init so that logits are
well separated and greedy decoding is not decided by float rounding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)


def _spread_init(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)


def make_checkpoint(path: Path, kind: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Writes a tiny random model of `kind` (llama, qwen2, qwen3, mistral, phi3) to `path`."""
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
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _spread_init(model, seed)
    model.save_pretrained(path, safe_serialization=True)
    return path


def load_hf(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
