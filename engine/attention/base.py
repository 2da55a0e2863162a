"""The attention backend interface and the per-step batch layout it reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, TypeVar

import torch


@dataclass
class AttentionPlan:
    """What a backend derives from one step's batch layout in ``prepare`` and every layer of the
    step reads. Each backend has its own subclass; a plan is valid for the one
    ``AttentionMetadata`` it was made from and is never reused across steps."""


PlanT = TypeVar("PlanT", bound=AttentionPlan)


class NativeSeqs(NamedTuple):
    """The arguments of one native paged-attention call over a set of sequences of the step, in
    step order (all int64, contiguous, ``n`` sequences): ``block_tables [n, max_blocks]``,
    ``seq_lens [n]`` (context lengths), ``query_start [n]`` (each sequence's first row in the flat
    batch) and ``query_len [n]``."""

    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor
    query_len: torch.Tensor


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
    # Set by the backend's ``prepare``: per-step tensors derived once for every layer.
    plan: AttentionPlan | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    def plan_as(self, kind: type[PlanT]) -> PlanT:
        """The step's plan, which must be a ``kind``: the backend reading it is the one that
        prepared it (or a subclass of it)."""
        if not isinstance(self.plan, kind):
            found = type(self.plan).__name__
            raise TypeError(f"attention metadata holds a {found}, not a {kind.__name__}")
        return self.plan


class AttentionBackend:
    """Writes a layer's new K/V into the paged cache and attends over each sequence's context.

    The KV cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` (the layout flash-attention's paged kernels read).

    Invariant: within a layer, every token's K/V of the step is written to the cache before any
    attention of that layer reads the cache. A request admitted in a step may therefore read
    blocks that another request of the same step computes in it (``engine.step_sharing``): its
    queries see that layer's K/V of every token of those blocks. Each path keeps it:

    * ``torch``: ``forward`` stores the whole step (``write_kv``) before the decodes' gather and
      each prefill's SDPA; a prefill chunk that is its sequence's whole context attends over its
      own K/V instead of the cache, and a request reading another's blocks always has context
      before its chunk, so it reads the cache.
    * ``cpu``: the same store first (one native ``write_kv_cache`` call, an OpenMP loop that
      ends before the call returns), then the native kernel, the per-sequence SDPA calls and the
      shared-prefix split, all of which only read the cache; the batched SDPA calls over whole
      prompts read only their own K/V, like the torch path's whole-context chunks. The split's prefix is made of
      blocks before every query of the step, so blocks computed in the step are never in it.
    * the native decoder stack (``engine.model.native_forward``, ``csrc/llama_forward.c``):
      per layer, ``write_kv_cache`` over all the step's rows, then one ``paged_attention`` call
      over all its sequences, one after the other.
    * ``flash``: ``write_kv`` (``index_copy_``) is queued on the current CUDA stream before the
      kernel that reads the cache, so the kernel starts after the copy, captured decode graphs
      included (the capture keeps the order).
    """

    name = "base"
    # Whether ``forward`` takes the keyword options ``window`` (sliding-window layers) and
    # ``softcap`` (tanh soft-capping of the scores); models that need them run elsewhere.
    supports_window = False
    supports_softcap = False
    # Whether a pure-decode step (``num_decodes`` equal to the number of sequences) can be
    # captured in a CUDA graph: for metadata whose tensors stay at fixed addresses, ``prepare``
    # and ``forward`` launch only device work, never sync with the host, and read no Python
    # value of the metadata but shapes and ``num_decodes`` (not ``max_seq_len``,
    # ``seq_lens_list`` or ``query_start_loc_list``).
    supports_cuda_graphs = False

    def prepare(self, meta: AttentionMetadata) -> None:
        """Set ``meta.plan``: the per-step tensors every layer of the step shares."""

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

    def native_step(self, meta: AttentionMetadata) -> NativeSeqs | None:
        """After ``prepare``: where every layer's attention of this step is one call of the
        native kernel over the whole batch (``engine.kernels.native.paged_attention`` from
        position 0), that call's arguments; else None. Lets a native model forward run the step
        without this object."""
        return None
