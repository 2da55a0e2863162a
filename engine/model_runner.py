"""Packs a step into one flat batch, runs the model, samples.

The runner owns the KV cache tensors (one K and one V tensor per layer, ``[num_blocks,
block_size, num_kv_heads, head_dim]``); which block belongs to whom is the KVCacheManager's
business and arrives here as explicit block id lists.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.cuda_graph import DecodeGraphs, GraphCapture, graph_sizes
from engine.model.config import ModelConfig
from engine.model.llama import LlamaForCausalLM
from engine.request import Request
from engine.sampler import Sampler, SamplerOutput, TokenLogprobs, token_logprobs

logger = logging.getLogger(__name__)

# Rows of prompt logits computed at once: 256 x a 49k vocabulary is 50 MB of float32.
PROMPT_LOGITS_ROWS = 256


@dataclass
class ScheduledSeq:
    request: Request
    num_new_tokens: int
    block_ids: list[int]


@dataclass
class PromptRows:
    """Hidden rows of one request's prefill chunk whose logits score prompt tokens
    (``targets``: the prompt tokens those rows predict, in order)."""

    request: Request
    rows: list[int]
    targets: list[int]


@dataclass
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sample_requests: list[Request]
    prompt_rows: list[PromptRows]
    # (row of ``input_ids``, request, position): input tokens still being sampled when the batch
    # was prepared (``Request.num_inflight_tokens``); ``fill_pending`` writes them in.
    pending: list[tuple[int, Request, int]] = field(default_factory=list)
    # Whether ``run`` replays a captured decode graph (decided once, in ``prepare``: the
    # backend's eager plan is only made when it does not).
    replay_graph: bool = False

    def fill_pending(self) -> None:
        """Write the tokens that were in flight at ``prepare`` into ``input_ids``; each must
        have been appended to its request since."""
        if not self.pending:
            return
        dev = self.input_ids.device
        rows = torch.tensor([row for row, _, _ in self.pending], device=dev)
        tokens = torch.tensor([r.all_token_ids[pos] for _, r, pos in self.pending], device=dev)
        self.input_ids[rows] = tokens
        self.pending = []


@dataclass
class StepOutput:
    """The requests that sampled a token this step and what they sampled, and the prompt
    logprobs computed this step (entries to append to each request's ``prompt_logprobs``)."""

    sampled: list[Request]
    sampler: SamplerOutput
    prompt_logprobs: list[tuple[Request, list[TokenLogprobs]]]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        model_cfg: ModelConfig,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        sampler: Sampler,
        capture: GraphCapture | None = None,
        max_num_seqs: int = 1,
        max_model_len: int = 1,
    ) -> None:
        """With ``capture``, pure-decode steps of up to ``max_num_seqs`` sequences replay graphs
        captured here (``engine.cuda_graph``); the cache then holds one block more than
        ``num_blocks``, the padding rows' scratch block (index ``num_blocks``), which the block
        pool, sized ``num_blocks``, never hands out."""
        self.model = model
        self.cfg = model_cfg
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.sampler = sampler
        scratch = 1 if capture is not None else 0
        shape = (num_blocks + scratch, block_size, model_cfg.num_kv_heads, model_cfg.head_dim)
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
            for _ in range(model_cfg.num_layers)
        ]
        self.graphs: DecodeGraphs | None = None
        if capture is not None:
            graphs = DecodeGraphs(
                model,
                self.kv_caches,
                graph_sizes(max_num_seqs),
                block_size,
                max_model_len,
                scratch_block=num_blocks,
                device=device,
            )
            try:
                graphs.capture(capture)
            except RuntimeError:
                # Serving eagerly beats not serving; the traceback says what to fix.
                logger.exception("decode graphs are off: every step runs eagerly")
            else:
                self.graphs = graphs

    @property
    def graph_replays(self) -> int:
        """Decode steps that replayed a captured graph so far."""
        return self.graphs.replays if self.graphs is not None else 0

    def prepare(self, seqs: list[ScheduledSeq]) -> BatchInputs:
        """Order decodes first and build every per-step tensor once. A request's newest tokens
        may still be in flight (``Request.num_inflight_tokens``): their rows hold a placeholder
        until ``BatchInputs.fill_pending``. Touches no engine state, so it may run on another
        thread while a forward runs; its tensor ops are too small to start an OpenMP team."""
        seqs = sorted(seqs, key=lambda s: s.num_new_tokens != 1)
        num_decodes = sum(1 for s in seqs if s.num_new_tokens == 1)
        input_ids: list[int] = []
        starts: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        prompt_rows: list[PromptRows] = []
        pending: list[tuple[int, Request, int]] = []
        max_blocks = 1
        for i, s in enumerate(seqs):
            r = s.request
            start = r.num_computed_tokens
            end = start + s.num_new_tokens
            if r.prompt_logprobs:
                # Position p scores prompt token p + 1; skip tokens scored before a preemption.
                first = max(start, len(r.prompt_logprobs) - 1)
                last = min(end, r.num_prompt_tokens - 1)
                if first < last:
                    base = qsl[-1] - start
                    prompt_rows.append(
                        PromptRows(
                            r,
                            list(range(base + first, base + last)),
                            r.prompt_token_ids[first + 1 : last + 1],
                        )
                    )
            known = r.all_token_ids[start:end]
            for pos in range(start + len(known), end):
                pending.append((len(input_ids) + pos - start, r, pos))
            input_ids.extend(known)
            input_ids.extend([0] * (end - start - len(known)))
            starts.append(start)
            qsl.append(qsl[-1] + s.num_new_tokens)
            seq_lens.append(end)
            max_blocks = max(max_blocks, len(s.block_ids))
            if end >= r.num_tokens + r.num_inflight_tokens:
                sample_rows.append(i)
                sample_requests.append(r)
        # One tensor from padded lists: a tensor per row costs ~10 us each at 64 rows.
        tables = torch.tensor(
            [s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in seqs], dtype=torch.int64
        )

        num_tokens = qsl[-1]
        qlens = torch.tensor([s.num_new_tokens for s in seqs], dtype=torch.int64)
        # Not torch.repeat_interleave: it always enters an OpenMP parallel region, which on a
        # planning thread would start a second team (engine.step_pipeline).
        seq_idx = torch.tensor(
            [i for i, s in enumerate(seqs) for _ in range(s.num_new_tokens)], dtype=torch.int64
        )
        qsl_t = torch.tensor(qsl, dtype=torch.int64)
        positions = torch.arange(num_tokens) - qsl_t[:-1][seq_idx] + torch.tensor(starts)[seq_idx]
        slots = tables[seq_idx, positions // self.block_size] * self.block_size + (
            positions % self.block_size
        )
        logits_indices = qsl_t[1:][sample_rows] - 1

        dev = self.device
        meta = AttentionMetadata(
            num_tokens=num_tokens,
            num_decodes=num_decodes,
            block_size=self.block_size,
            slot_mapping=slots.to(dev),
            query_start_loc=qsl_t.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64).to(dev),
            block_tables=tables.to(dev),
            max_query_len=int(qlens.max()),
            max_seq_len=max(seq_lens),
            query_start_loc_list=qsl,
            seq_lens_list=seq_lens,
        )
        batch = BatchInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(dev),
            positions=positions.to(dev),
            meta=meta,
            logits_indices=logits_indices.to(dev),
            sample_requests=sample_requests,
            prompt_rows=prompt_rows,
            pending=pending,
        )
        # A graph replay prepares its own static metadata.
        batch.replay_graph = self._replays(batch)
        if not batch.replay_graph:
            self.backend.prepare(meta)
        return batch

    def _replays(self, batch: BatchInputs) -> bool:
        """Whether ``run`` replays a decode graph for ``batch``: it qualifies, samples, and
        needs no prompt row's hidden state."""
        return (
            self.graphs is not None
            and bool(batch.sample_requests)
            and not batch.prompt_rows
            and self.graphs.qualifies(batch.meta)
        )

    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSeq]) -> StepOutput:
        """Run one step: the model over every scheduled token, then the sampler over the rows
        that end a request's known tokens."""
        return self.run(self.prepare(seqs))

    @torch.inference_mode()
    def run(self, batch: BatchInputs) -> StepOutput:
        """``execute`` of a batch already prepared (every pending token filled in)."""
        assert not batch.pending, "fill_pending() first"
        if batch.replay_graph:
            assert self.graphs is not None
            logits = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
            assert logits is not None
            if len(batch.sample_requests) < logits.shape[0]:
                logits = logits[batch.logits_indices]
            sampled = self.sampler(logits, batch.sample_requests)
            return StepOutput(batch.sample_requests, sampled, [])
        # Prompt logprobs read every prompt row's hidden state; otherwise, where a prompt chunk
        # samples fewer rows than it computes, only the sampled rows go through the last layer.
        sampled = batch.logits_indices
        pruned = not batch.prompt_rows and sampled.numel() < batch.input_ids.numel()
        keep = sampled if pruned else None
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, keep)
        prompt_logprobs = [(p.request, self._prompt_logprobs(hidden, p)) for p in batch.prompt_rows]
        if not batch.sample_requests:
            return StepOutput([], SamplerOutput([], []), prompt_logprobs)
        logits = self.model.compute_logits(hidden if pruned else hidden[sampled])
        return StepOutput(
            batch.sample_requests, self.sampler(logits, batch.sample_requests), prompt_logprobs
        )

    def _prompt_logprobs(self, hidden: torch.Tensor, p: PromptRows) -> list[TokenLogprobs]:
        k = p.request.sampling_params.prompt_logprobs or 0
        entries: list[TokenLogprobs] = []
        for c in range(0, len(p.rows), PROMPT_LOGITS_ROWS):
            rows = torch.tensor(p.rows[c : c + PROMPT_LOGITS_ROWS], device=self.device)
            targets = p.targets[c : c + PROMPT_LOGITS_ROWS]
            logits = self.model.compute_logits(hidden[rows])
            entries += token_logprobs(logits, targets, [k] * len(targets))
        return entries

    # -- KV transfer (prefix sharing between replicas) --------------------------------------------
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """KV of the given blocks as one tensor ``[layers, 2, n, block_size, kv_heads, dim]``."""
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        return torch.stack(
            [
                torch.stack((k.index_select(0, idx), v.index_select(0, idx)))
                for k, v in self.kv_caches
            ]
        )

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        idx = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        data = data.to(device=self.device, dtype=self.dtype)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, idx, data[layer, 0])
            v.index_copy_(0, idx, data[layer, 1])
