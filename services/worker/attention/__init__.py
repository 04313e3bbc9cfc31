"""Attention backends: the interface, the torch (CPU) implementation, and the selector."""

from services.worker.attention.base import AttentionBackend, AttentionMetadata
from services.worker.attention.selector import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
