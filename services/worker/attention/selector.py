"""Chooses the attention backend for a device; PAGODA_ATTENTION_BACKEND overrides."""

from __future__ import annotations

import os

import torch

from services.worker.attention.base import AttentionBackend
from services.worker.attention.torch_backend import TorchAttentionBackend

ENV_VAR = "PAGODA_ATTENTION_BACKEND"
_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttentionBackend}


def get_attention_backend(device: torch.device, override: str | None = None) -> AttentionBackend:
    """torch on the CPU; the Triton backend on CUDA once it exists (kernels issue)."""
    name = override or os.environ.get(ENV_VAR) or "torch"
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r} (from {ENV_VAR} or config); "
            f"available: {', '.join(sorted(_BACKENDS))}"
        )
    return _BACKENDS[name]()
