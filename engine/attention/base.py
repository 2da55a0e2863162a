"""The attention backend interface and the per-step batch layout it reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Layout of one flat batch, built once per step by the ModelRunner.

    Sequences are ordered decodes first: sequences ``[0, num_decodes)`` have exactly one query
    token each, so tokens ``[0, num_decodes)`` are theirs. Sequence ``i`` owns query tokens
    ``[query_start_loc[i], query_start_loc[i+1])`` at positions ``seq_lens[i] - query_len ..
    seq_lens[i] - 1``; its KV lives in blocks ``block_tables[i, :cdiv(seq_lens[i], block_size)]``
    (the row is padded with zeros). ``slot_mapping[t]`` is the flat KV slot that token ``t`` writes.
    """

    num_tokens: int
    num_decodes: int
    block_size: int
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_start_loc_list: list[int]
    seq_lens_list: list[int]
    # Backend-specific tensors derived once per step (masks, gathered indices).
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


class AttentionBackend:
    """Writes a layer's new K/V into the paged cache and attends over each sequence's context.

    The KV cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` (the layout flash-attention's paged kernels read).
    """

    name = "base"
    # Whether ``forward`` takes the keyword options ``window`` (sliding-window layers) and
    # ``softcap`` (tanh soft-capping of the scores); models that need them run elsewhere.
    supports_window = False
    supports_softcap = False

    def prepare(self, meta: AttentionMetadata) -> None:
        """Precompute per-step tensors shared by every layer (stored in ``meta.extra``)."""

    @staticmethod
    def write_kv(
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Store the step's new K/V rows in their cache slots (``meta.slot_mapping``)."""
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """``q [T, H, D]``, ``k``/``v [T, Hkv, D]`` -> ``[T, H, D]``. A backend that
        ``supports_window`` / ``supports_softcap`` also takes ``window=`` (a query at position
        ``p`` sees keys ``p - window + 1 .. p``) and ``softcap=`` (scores -> ``cap *
        tanh(scores / cap)`` before the mask); a model passes them only for layers that need
        them."""
        raise NotImplementedError

    def native_step(self, meta: AttentionMetadata) -> tuple[torch.Tensor, ...] | None:
        """After ``prepare``: where every layer's attention of this step is one call of the
        native kernel over the whole batch (``engine.attention.native.paged_attention`` from
        position 0), that call's ``(block_tables, seq_lens, query_start, query_len)``; else
        None. Lets a native model forward run the step without this object."""
        return None


def flash_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import vllm_flash_attn  # noqa: F401
    except Exception:
        return False
    return True


def native_cpu_available(device: torch.device) -> bool:
    if device.type != "cpu":
        return False
    from engine.attention import native

    return native.available()


def select_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """``auto`` picks flash-attention on CUDA when ``vllm_flash_attn`` imports; on CPU the native
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
            raise ValueError("attention_backend: flash needs a CUDA device and vllm-flash-attn")
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
