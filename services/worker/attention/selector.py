"""Chooses the attention backend for a device; the ``attention_backend`` setting overrides.

Triton on CUDA when the triton package is installed; on the CPU the C++ decode kernel
(``cpu``) when it builds on this machine, else the pure torch path. The Triton
backend module is imported only when chosen: importing it decorates the kernels,
which fixes whether they run compiled or in the interpreter (TRITON_INTERPRET).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from services.worker.attention.base import AttentionBackend
from services.worker.attention.torch_backend import CpuAttentionBackend, TorchAttentionBackend
from shared.config import SETTINGS_BY_KEY, resolve_setting

ENV_VAR = SETTINGS_BY_KEY["attention_backend"].env  # PAGODA_ATTENTION_BACKEND


def _triton_backend() -> AttentionBackend:
    from services.worker.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": TorchAttentionBackend,
    "cpu": CpuAttentionBackend,
    "triton": _triton_backend,
}


def default_backend_name(device: torch.device) -> str:
    if device.type == "cuda":
        return "triton" if importlib.util.find_spec("triton") is not None else "torch"
    from kernels import cpu_decode

    return "cpu" if cpu_decode.available() else "torch"


def get_attention_backend(device: torch.device, override: str | None = None) -> AttentionBackend:
    """See the module docstring. ``override`` (the config's ``attention_backend``) wins
    unless it is None or ``auto``; then the setting's env variable, else the default."""
    name = override if override not in (None, "auto") else resolve_setting("attention_backend")
    if name == "auto":
        name = default_backend_name(device)
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r} (from {ENV_VAR} or config); "
            f"available: {', '.join(sorted(_BACKENDS))}"
        )
    return _BACKENDS[name]()
