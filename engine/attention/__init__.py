"""Attention backends: one interface (``base``), a PyTorch path (CPU and reference), a native CPU
path and flash-attention on CUDA.

The registry lives here, not in ``base``: the backends import the interface, and the package
picks among them, so nothing imports in a circle.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "backend_for_model", "select_backend"]


def flash_available(device: torch.device) -> bool:
    """Whether ``device`` is CUDA and a flash kernel provider loads (``vllm_flash_attn``,
    ``flash_attn`` or our Triton kernels; see ``engine.attention.flash_kernels``)."""
    if device.type != "cuda":
        return False
    from engine.attention.flash_kernels import load_flash_kernels

    return load_flash_kernels() is not None


def native_cpu_available(device: torch.device) -> bool:
    if device.type != "cpu":
        return False
    from engine.kernels import native

    return native.available()


def select_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """``auto`` picks flash-attention on CUDA when a flash kernel provider loads; on CPU the native
    paged decode kernel when it builds (``cpu``); else the pure-PyTorch ``torch`` backend."""
    if name == "auto":
        if flash_available(device) and dtype != torch.float32:
            name = "flash"
        elif native_cpu_available(device):
            name = "cpu"
        else:
            name = "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError("attention_backend: cpu runs on the CPU device only")
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(dtype)
    if name == "flash":
        if not flash_available(device):
            raise ValueError(
                "attention_backend: flash needs a CUDA device and one of vllm-flash-attn, "
                "flash-attn or triton"
            )
        if dtype == torch.float32:
            raise ValueError("attention_backend: flash supports float16 and bfloat16 only")
        from engine.attention.flash_backend import FlashAttentionBackend

        return FlashAttentionBackend()
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ValueError(f"attention_backend: unknown backend {name!r}")


def backend_for_model(
    backend: AttentionBackend, needs_window: bool, needs_softcap: bool
) -> AttentionBackend:
    """``backend``, or the reference ``torch`` backend where the model needs a sliding window or
    soft-capping that ``backend`` does not compute."""
    if (needs_window and not backend.supports_window) or (
        needs_softcap and not backend.supports_softcap
    ):
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    return backend
