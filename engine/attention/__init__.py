"""Attention backends: one interface, a PyTorch path (CPU and reference) and flash-attention on CUDA."""

from engine.attention.base import AttentionBackend, AttentionMetadata, select_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "select_backend"]
