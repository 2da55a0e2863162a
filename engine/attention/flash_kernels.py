"""Where the flash backend's kernels come from: the first of ``vllm_flash_attn``, Dao's
``flash_attn`` and our Triton kernels (``engine.kernels.triton_flash``) that loads.

All three expose ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` with the keyword
arguments the backend passes. The Triton provider is offered only on a machine with CUDA (its
kernels compile for a GPU); forcing it by name also loads it without one, which is how the CPU
interpreter (``TRITON_INTERPRET=1``) runs it in tests. Nothing here imports a provider at module
level, so importing the engine on CPU never needs triton.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

PROVIDERS = ("vllm_flash_attn", "flash_attn", "triton")


@dataclass(frozen=True)
class FlashKernels:
    """One provider's two entry points. ``block_multiple``: the KV block sizes it accepts are
    multiples of this (the CUDA packages' paged layout needs 16; the Triton kernels take any)."""

    name: str
    varlen: Callable[..., torch.Tensor]
    with_kvcache: Callable[..., torch.Tensor]
    block_multiple: int


def _import(name: str) -> FlashKernels:
    """The provider ``name``'s kernels; raises (ImportError or whatever the import raises) when
    it does not load."""
    module_name = "engine.kernels.triton_flash" if name == "triton" else name
    module = importlib.import_module(module_name)
    return FlashKernels(
        name=name,
        varlen=module.flash_attn_varlen_func,
        with_kvcache=module.flash_attn_with_kvcache,
        block_multiple=1 if name == "triton" else 16,
    )


@functools.cache
def load_flash_kernels(name: str | None = None) -> FlashKernels | None:
    """``name``: that provider, or raise ValueError naming why it does not load. None: the first
    provider of ``PROVIDERS`` that loads (the Triton one only when CUDA is available), or None."""
    if name is not None:
        if name not in PROVIDERS:
            raise ValueError(f"unknown flash kernel provider {name!r}; one of {PROVIDERS}")
        try:
            return _import(name)
        except Exception as e:
            raise ValueError(f"flash kernel provider {name!r} does not load: {e!r}") from e
    for candidate in PROVIDERS:
        if candidate == "triton" and not torch.cuda.is_available():
            continue
        try:
            return _import(candidate)
        except Exception as e:
            # A package built for another torch fails with more than ImportError.
            logger.debug("flash kernel provider %s does not load: %r", candidate, e)
    return None
