"""Kernels: the native CPU library, C/OpenMP sources (``csrc/``) compiled at first use into a
per-user cache (``kernel_cache``) and called through ctypes (``native``); and FlashAttention in
Triton for CUDA (``triton_flash``), imported only by the flash backend's provider registry.

Attention backends, model layers and the sampler call into it; it imports no attention backend
or model layer (only ``engine.cpuinfo`` and the model cache directory's location).
"""
