"""CUDA graphs of pure-decode steps: one graph per padded batch size, captured at start-up and
replayed instead of launching a decode step's hundreds of small kernels one by one.

A graph replays the exact kernels it captured on the exact buffers it captured, so every input
of a captured step lives in a static buffer that :meth:`DecodeGraphs.run` fills in place: token
ids, positions, KV slots, context lengths, block tables and query offsets. A batch of ``n``
decodes runs the smallest captured size ``>= n``; the ``size - n`` padding rows attend to one
token of the scratch KV block (an extra block past the pool's that the block pool never hands
out) and write their K/V there, so they touch no sequence's cache.

Capturing is behind :class:`GraphCapture`: :class:`CudaGraphCapture` records real CUDA graphs;
a test may pass a capture that calls the function again on replay, which checks this module's
padding and buffer logic on CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata

if TYPE_CHECKING:
    from engine.model.llama import LlamaForCausalLM

# Runs of the step before its capture: lazy initialisation (cuBLAS handles and workspaces,
# Triton's compilation and autotuning) must not happen inside a capture.
WARMUP_RUNS = 2


def graph_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes captured, ascending: 1, 2, 4, 8, then steps of 8 (vLLM's
    ladder), up to and including ``max_num_seqs``, so that every decode batch fits one."""
    ladder = [1, 2, 4, *range(8, max_num_seqs + 8, 8)]
    return [s for s in ladder if s < max_num_seqs] + [max_num_seqs]


def use_cuda_graphs(device: torch.device, backend: AttentionBackend, enforce_eager: bool) -> bool:
    """Whether an engine on ``device`` with ``backend`` captures decode graphs: on CUDA, unless
    ``enforce_eager``, with a backend that promises graph-safe decode steps."""
    return (
        device.type == "cuda"
        and not enforce_eager
        and bool(getattr(backend, "supports_cuda_graphs", False))
    )


@dataclass
class Captured:
    """A captured step: ``replay()`` reruns it, leaving its result in ``output``."""

    replay: Callable[[], None]
    output: torch.Tensor


class GraphCapture(Protocol):
    """Records ``fn`` (which reads only static buffers and returns a fresh tensor) once."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Captured: ...


class CudaGraphCapture:
    """Real CUDA graphs, all allocating from one memory pool (capture the largest first, so
    that the smaller graphs fit in the memory it already holds)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> Captured:
        # Warm up on a side stream, as torch requires before capturing.
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        torch.cuda.synchronize(self.device)
        return Captured(graph.replay, output)


class DecodeGraphs:
    """Static decode-step buffers and one captured graph per size of :func:`graph_sizes`.

    Invariants: rows ``[0, size)`` of every buffer are what graph ``size`` reads; before each
    replay rows ``[0, n)`` hold the step's ``n`` decodes and rows ``[n, size)`` padding (token 0
    at position 0, context length 1, every block table entry and the KV slot in the scratch
    block). ``query_start_loc`` is ``0..max_size`` and never changes (one query per row).
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        sizes: list[int],
        block_size: int,
        max_model_len: int,
        scratch_block: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.scratch_block = scratch_block
        self.device = device
        max_bs = self.sizes[-1]
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        i64 = {"dtype": torch.int64, "device": device}
        self.input_ids = torch.zeros(max_bs, **i64)
        self.positions = torch.zeros(max_bs, **i64)
        self.slot_mapping = torch.full((max_bs,), scratch_block * block_size, **i64)
        self.seq_lens = torch.ones(max_bs, **i64)
        self.block_tables = torch.full((max_bs, self.max_blocks_per_seq), scratch_block, **i64)
        self.query_start_loc = torch.arange(max_bs + 1, **i64)
        self.graphs: dict[int, Captured] = {}
        # Replays so far (tests and stats read it).
        self.replays = 0

    def meta(self, size: int) -> AttentionMetadata:
        """The static metadata of graph ``size``: views of the buffers. Its Python fields hold
        bounds, not this step's values (``max_seq_len`` is ``max_model_len``; the lists hold
        one entry per row, for ``num_seqs``): a graph-safe backend reads none of them."""
        return AttentionMetadata(
            num_tokens=size,
            num_decodes=size,
            block_size=self.block_size,
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc_list=list(range(size + 1)),
            seq_lens_list=[self.max_model_len] * size,
        )

    def capture(self, capturer: GraphCapture) -> None:
        """Capture every size, largest first, over padding-only buffers (their K/V writes land
        in the scratch block). Raises RuntimeError naming the size and backend that failed."""
        self._pad(0)
        backend = self.model.backend
        with torch.inference_mode():
            for size in reversed(self.sizes):
                meta = self.meta(size)
                ids, pos = self.input_ids[:size], self.positions[:size]

                def step(meta: AttentionMetadata = meta, ids=ids, pos=pos) -> torch.Tensor:
                    backend.prepare(meta)
                    hidden = self.model(ids, pos, self.kv_caches, meta)
                    return self.model.compute_logits(hidden)

                try:
                    self.graphs[size] = capturer.capture(step)
                except Exception as e:
                    raise RuntimeError(
                        f"decode graphs: capturing batch size {size} with the {backend.name} "
                        f"attention backend failed: {e}"
                    ) from e

    def size_for(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds ``num_seqs`` rows, or None."""
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def qualifies(self, meta: AttentionMetadata) -> bool:
        """Whether a graph runs the step laid out by ``meta``: every sequence decodes, and no
        more of them than the largest graph holds."""
        n = meta.num_seqs
        size = self.size_for(n)
        return (
            n > 0
            and meta.num_decodes == n == meta.num_tokens
            and size is not None
            and size in self.graphs
            and meta.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        """The logits ``[num_seqs, vocab]`` of a pure-decode step (a view of the graph's static
        output, valid until the next replay), or None when the step does not ``qualify``. Reads
        no plan of ``meta``: the graph prepares its own."""
        if not self.qualifies(meta):
            return None
        n = meta.num_seqs
        size = self.size_for(n)
        assert size is not None
        width = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        # Columns past the step's widest table: never read below a row's context length.
        self.block_tables[:n, width:].fill_(self.scratch_block)
        self._pad(n)
        graph = self.graphs[size]
        graph.replay()
        self.replays += 1
        return graph.output[:n]

    def _pad(self, n: int) -> None:
        """Rows ``[n, max)`` become padding rows."""
        self.input_ids[n:].zero_()
        self.positions[n:].zero_()
        self.seq_lens[n:].fill_(1)
        self.slot_mapping[n:].fill_(self.scratch_block * self.block_size)
        self.block_tables[n:].fill_(self.scratch_block)
