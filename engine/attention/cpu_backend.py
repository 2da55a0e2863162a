"""CPU attention: the native paged kernel where PyTorch's per-call overhead dominates, SDPA where
its blocked kernel wins, and a shared-prefix split when a whole step starts from the same cache.

Per sequence of a step:

- decodes, and prefill chunks with few (query, key) pairs, go through one native call
  (``engine.kernels.native.paged_attention``) that reads each cached row straight through the
  block table: no gathered copy, no padding, no call per sequence;
- longer prefill chunks keep the PyTorch path, whose GEMM-based kernel is several times faster
  per pair than the kernel's generic loop: chunks that are their sequence's whole context (a
  fresh prompt) go in batches of similar lengths, one SDPA call per batch, right-padded to the
  batch's longest (a causal row never sees the padding after it); the others one SDPA call
  each, over a gathered context; except in bf16 on CPUs with AMX or AVX512-BF16, where the
  kernel's AMX tiles (``csrc/attention_amx.c``) or its AVX512-BF16 tile
  (``csrc/attention_tile_bf16.c``) are faster than SDPA at every length, so every chunk takes
  the native call (``native.bf16_prefill_preferred``; docs/performance.md).

Shared prefix ("cascade"): when every sequence's block table starts with the same ``P`` blocks
and all queries come after them (many requests behind one system prompt, decoding together),
the prefix is attended once for all query rows of the step, one SDPA call per layer over a
single gathered copy, and the native kernel covers only each sequence's own keys (from position
``P * block_size``); the two halves are merged by their log-sum-exp. Taken only when it saves
work: enough rows times prefix tokens to pay for the extra call. A run of consecutive sequences
can split the same way while the rest of the step does not: a burst behind a new system prompt,
whose leader computes the prefix in the same step and whose followers' chunks read it, would
otherwise take an SDPA call per follower over a gathered copy of the prefix. Where the kernel's
bf16 tiles take every prefill chunk, only decodes join a split (the tiles beat its SDPA call).

Selected by ``attention_backend="cpu"``, or by ``auto`` on CPU when the kernel builds; without a
C compiler ``auto`` falls back to ``torch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionMetadata, AttentionPlan, NativeSeqs
from engine.attention.torch_backend import TorchAttentionBackend, TorchAttentionPlan, torch_plan
from engine.kernels import native

# A prefill chunk takes the native kernel while its (query, key) pairs are at most this many:
# below, SDPA's fixed cost per call dominates; above, its blocked kernel (cheaper per pair)
# wins. Measured at head_dim 64, bf16 and fp32 alike (docs/performance.md, item 7).
NATIVE_MAX_PAIRS = 4096
# The shared-prefix split costs one more SDPA call per layer and saves the kernel's pass over
# the prefix for every sequence: worth it from about 64 sequences x 256 prefix tokens (or fewer
# sequences with a longer prefix; docs/performance.md, item 8).
CASCADE_MIN_PAIRS = 16384
# Where bf16 decodes take the one-pass AVX512-BF16 kernel (``native.bf16_decode_one_pass``), its
# pass over a prefix in cache is cheap enough that the split wins only from about 64 sequences x
# 1,024 prefix tokens, and a step that splits also leaves the one-call native stack
# (docs/performance.md, item 29): the threshold is this many times CASCADE_MIN_PAIRS.
ONE_PASS_CASCADE_FACTOR = 4
# In float32 where decode steps take the one-call native stack (the float32 linear kernel runs,
# ``native.f32_linear_preferred``), leaving it for the split costs more than the split saves
# below about 64 sequences x 768 prefix tokens (docs/performance.md, item 33).
F32_STACK_CASCADE_FACTOR = 3
# Whole-prompt chunks batched into one SDPA call: the longest at most this many times the
# shortest, so that padding costs less than the per-call overhead it saves (one call for 20
# prompts of 100 tokens takes two thirds of 20 calls' time; docs/performance.md).
SDPA_BATCH_MAX_SPREAD = 1.25
_sdpa_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _pairs(qlen: int, keys: int) -> int:
    """(query, key) pairs of a causal chunk of ``qlen`` queries ending at the last of ``keys``."""
    return qlen * keys - qlen * (qlen - 1) // 2


@dataclass
class SdpaBatch:
    """Whole-prompt chunks attended in one SDPA call. ``seqs``: indices into the step's
    sequences; ``max_len``: the longest chunk; ``rows``: ``[len(seqs), max_len]`` token indices
    into the step's rows, each padded with its sequence's last row; ``real``: the flat positions
    of the real (not padding) entries of ``rows``, in step order, and ``tokens`` the step rows
    they are; ``span``: ``(start, end)`` when the chunks are consecutive and of one length, so that
    the step's rows are viewed as the batch without a copy (then ``rows`` etc. are None)."""

    seqs: list[int]
    max_len: int
    rows: torch.Tensor | None = None
    real: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    span: tuple[int, int] | None = None


def sdpa_batches(
    seqs: list[int], qsl: list[int], qlens: list[int], lens: list[int]
) -> tuple[list[SdpaBatch], list[int]]:
    """Group the whole-prompt chunks among ``seqs`` (``qlens[i] == lens[i]``) into batches of
    similar lengths; returns the batches of two or more and the sequences left for a call each."""
    fresh = sorted((i for i in seqs if qlens[i] == lens[i]), key=lambda i: qlens[i])
    groups: list[list[int]] = []
    for i in fresh:
        if groups and qlens[i] <= SDPA_BATCH_MAX_SPREAD * qlens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    batches, alone = [], [i for i in seqs if qlens[i] != lens[i]]
    for group in groups:
        if len(group) < 2:
            alone.extend(group)
            continue
        group.sort()
        longest = max(qlens[i] for i in group)
        starts = [qsl[i] for i in group]
        if all(qlens[i] == longest for i in group) and all(
            qsl[a + 1] == qsl[b] for a, b in zip(group, group[1:], strict=False)
        ):
            batches.append(SdpaBatch(group, longest, span=(starts[0], qsl[group[-1] + 1])))
            continue
        offsets = torch.arange(longest)
        qlen = torch.tensor([qlens[i] for i in group])
        rows = torch.tensor(starts)[:, None] + torch.minimum(offsets[None, :], qlen[:, None] - 1)
        mask = offsets[None, :] < qlen[:, None]
        real = mask.flatten().nonzero().squeeze(1)
        batches.append(
            SdpaBatch(group, longest, rows=rows.flatten(), real=real, tokens=rows.flatten()[real])
        )
    alone.sort()
    return batches, alone


@dataclass
class SharedPrefix:
    """A run of consecutive sequences of a step, ``seqs[0] <= i < seqs[1]``, whose block tables
    all start with the same ``tokens // block_size`` blocks (``blocks``: a slice of the cache
    when their ids are consecutive, else an int64 index tensor), every query of the run coming
    after them: the run's query rows ``rows[0]:rows[1]`` attend to the prefix in one SDPA call,
    and ``own`` is the native call over each sequence's keys from position ``tokens`` on."""

    seqs: tuple[int, int]
    rows: tuple[int, int]
    tokens: int
    blocks: slice | torch.Tensor
    own: NativeSeqs


@dataclass
class CpuAttentionPlan(AttentionPlan):
    """How the CPU backend splits one step between the native kernel and SDPA.

    Every sequence of the step is in exactly one of ``shared`` (its run of sequences),
    ``native_seqs`` (one native call over those sequences, in step order; None when there is
    none), ``sdpa_batches`` (whole-prompt chunks, one SDPA call per batch) and ``sdpa_seqs``
    (sorted indices into the step's sequences, one SDPA call each).
    ``reference`` is the reference backend's plan, made by the first layer of a step the native
    kernel cannot run (float16) and reused by the others; None until then.
    """

    native_seqs: NativeSeqs | None
    sdpa_seqs: list[int]
    sdpa_batches: list[SdpaBatch] = field(default_factory=list)
    shared: SharedPrefix | None = None
    reference: TorchAttentionPlan | None = None

    @property
    def shared_prefix_tokens(self) -> int:
        return self.shared.tokens if self.shared is not None else 0


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    # The native kernel reads every key of a context and has no soft-capping.
    supports_window = False
    supports_softcap = False

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        if not native.available():
            raise ValueError(
                "attention_backend: cpu needs the native kernel, which could not be built "
                "(no C compiler, or PREFIXSERVE_NATIVE_KERNELS=0)"
            )
        # Prefill chunks above this many (query, key) pairs go to SDPA (None: none do).
        self.native_max_pairs: int | None = NATIVE_MAX_PAIRS
        # Whole prompts of similar lengths share one SDPA call (off: a call each).
        self.batch_whole_prompts = True
        # Whether prefill chunks join a shared-prefix split (else only decodes do).
        self.split_chunks = True
        if dtype == torch.bfloat16 and native.bf16_prefill_preferred():
            self.native_max_pairs = None
            # The kernel's tiles attend a chunk faster than the split's SDPA call would.
            self.split_chunks = False
        # CASCADE_MIN_PAIRS is read at each step (tests lower it): this scales it.
        self.cascade_factor = 1
        if dtype == torch.bfloat16 and native.bf16_decode_one_pass():
            self.cascade_factor = ONE_PASS_CASCADE_FACTOR
        elif dtype == torch.float32 and native.f32_linear_preferred():
            self.cascade_factor = F32_STACK_CASCADE_FACTOR

    def _on_native(self, pairs: int) -> bool:
        return self.native_max_pairs is None or pairs <= self.native_max_pairs

    def prepare(self, meta: AttentionMetadata) -> None:
        qsl, lens = meta.query_start_loc_list, meta.seq_lens_list
        qlens = [qsl[i + 1] - qsl[i] for i in range(meta.num_seqs)]
        shared = self._shared_prefix(meta, qlens)
        in_run = range(*shared.seqs) if shared is not None else range(0)
        on_native = [
            i
            for i in range(meta.num_seqs)
            if i not in in_run and (qlens[i] == 1 or self._on_native(_pairs(qlens[i], lens[i])))
        ]
        to_sdpa = sorted(set(range(meta.num_seqs)) - set(on_native) - set(in_run))
        batches, alone = (
            sdpa_batches(to_sdpa, qsl, qlens, lens) if self.batch_whole_prompts else ([], to_sdpa)
        )
        meta.plan = CpuAttentionPlan(
            native_seqs=_native_seqs(meta, on_native, qlens),
            sdpa_seqs=alone,
            sdpa_batches=batches,
            shared=shared,
        )

    def reference_plan(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        plan = meta.plan_as(CpuAttentionPlan)
        if plan.reference is None:
            plan.reference = torch_plan(meta)
        return plan.reference

    def native_step(self, meta: AttentionMetadata) -> NativeSeqs | None:
        plan = meta.plan_as(CpuAttentionPlan)
        if plan.shared is not None or plan.sdpa_seqs or plan.sdpa_batches:
            return None
        return plan.native_seqs

    @staticmethod
    def write_kv(
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        if not native.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping):
            TorchAttentionBackend.write_kv(k, v, k_cache, v_cache, meta)

    def _shared_prefix(self, meta: AttentionMetadata, qlens: list[int]) -> SharedPrefix | None:
        """The step's shared-prefix split, if one pays for itself: over the run of consecutive
        sequences behind one first block with the most rows times prefix tokens (the whole step
        when all share it). Without ``split_chunks`` only decodes join a run."""
        n = meta.num_seqs
        if n < 2:
            return None
        bs, qsl = meta.block_size, meta.query_start_loc_list
        # Whole blocks before each sequence's first query; 0 where it may not join a run.
        ahead = [
            (ctx - q) // bs if q == 1 or self.split_chunks else 0
            for ctx, q in zip(meta.seq_lens_list, qlens, strict=True)
        ]
        firsts = meta.block_tables[:, 0].tolist()
        # (prefix pairs, first sequence, end, prefix tokens) of each run that would split.
        runs: list[tuple[int, int, int, int]] = []
        a = 0
        while a < n:
            b = a + 1
            while ahead[a] and b < n and ahead[b] and firsts[b] == firsts[a]:
                b += 1
            tokens = self._run_prefix(meta, a, b, qlens, ahead) if b - a >= 2 else 0
            if tokens:
                runs.append((tokens * (qsl[b] - qsl[a]), a, b, tokens))
            a = b
        if not runs:
            return None
        _, a, b, tokens = max(runs, key=lambda run: run[0])  # the first of equals
        return self._shared(meta, a, b, tokens, qlens)

    def _run_prefix(
        self, meta: AttentionMetadata, a: int, b: int, qlens: list[int], ahead: list[int]
    ) -> int:
        """Tokens of the longest run of leading blocks that sequences ``a`` to ``b - 1`` all
        share and that precede all their queries, if splitting there pays for itself (enough
        rows times prefix tokens, and every sequence's own keys short enough for the native
        kernel); else 0."""
        bs = meta.block_size
        min_pairs = CASCADE_MIN_PAIRS * self.cascade_factor
        rows = meta.query_start_loc_list[b] - meta.query_start_loc_list[a]
        limit = min(ahead[a:b])
        if limit * bs * rows < min_pairs:
            return 0
        tables = meta.block_tables[a:b, :limit]
        same = (tables == tables[:1]).all(dim=0)
        tokens = bs * (limit if bool(same.all()) else int(same.to(torch.int8).argmin()))
        if tokens * rows < min_pairs:
            return 0
        lens = meta.seq_lens_list
        if not all(self._on_native(_pairs(qlens[i], lens[i] - tokens)) for i in range(a, b)):
            return 0  # some chunk is long: its own keys would be slow in the native kernel
        return tokens

    @staticmethod
    def _shared(
        meta: AttentionMetadata, a: int, b: int, tokens: int, qlens: list[int]
    ) -> SharedPrefix:
        blocks = meta.block_tables[a, : tokens // meta.block_size]
        first = int(blocks[0])
        cached: slice | torch.Tensor = blocks.contiguous()
        if torch.equal(blocks, torch.arange(first, first + len(blocks))):
            # Consecutive ids (one allocation): read the cache in place, no gather.
            cached = slice(first, first + len(blocks))
        own = _native_seqs(meta, list(range(a, b)), qlens)
        assert own is not None
        qsl = meta.query_start_loc_list
        return SharedPrefix((a, b), (qsl[a], qsl[b]), tokens, cached, own)

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
        if q.dtype not in native.DTYPE_CODES:
            # float16 has no native path: the reference handles the whole step (its decode
            # path reads ``reference_plan``).
            return super().forward(q, k, v, k_cache, v_cache, meta, scale)
        plan = meta.plan_as(CpuAttentionPlan)
        # The whole step before any read: requests may read blocks others of the step write
        # (the invariant in AttentionBackend).
        self.write_kv(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        shared = plan.shared
        if shared is not None:
            part = torch.empty_like(q)
            part_lse = torch.empty(q.shape[:2], dtype=torch.float32)
            native.paged_attention(
                q, k_cache, v_cache, *shared.own, part, scale, kv_start=shared.tokens, lse=part_lse
            )
            r0, r1 = shared.rows
            self._merge_shared_prefix(
                q[r0:r1],
                k_cache,
                v_cache,
                shared.blocks,
                scale,
                part[r0:r1],
                part_lse[r0:r1],
                out[r0:r1],
            )
        if plan.native_seqs is not None:
            native.paged_attention(q, k_cache, v_cache, *plan.native_seqs, out, scale)
        for batch in plan.sdpa_batches:
            self.prefill_batch(q, k, v, scale, out, batch)
        for i in plan.sdpa_seqs:
            self.prefill_one(q, k, v, k_cache, v_cache, meta, scale, out, i)
        return out

    @staticmethod
    def prefill_batch(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        batch: SdpaBatch,
    ) -> None:
        """Causal attention of whole-prompt chunks over their own K/V, one SDPA call."""
        n, length = len(batch.seqs), batch.max_len
        heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
        if batch.span is not None:
            start, end = batch.span
            qb, kb, vb = q[start:end], k[start:end], v[start:end]
        else:
            assert batch.rows is not None
            qb, kb, vb = (t.index_select(0, batch.rows) for t in (q, k, v))
        o = F.scaled_dot_product_attention(
            qb.view(n, length, heads, dim).transpose(1, 2),
            kb.view(n, length, kv_heads, dim).transpose(1, 2),
            vb.view(n, length, kv_heads, dim).transpose(1, 2),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        ).transpose(1, 2)
        if batch.span is not None:
            out[batch.span[0] : batch.span[1]] = o.reshape(-1, heads, dim)
        else:
            assert batch.real is not None and batch.tokens is not None
            out.index_copy_(0, batch.tokens, o.reshape(-1, heads, dim).index_select(0, batch.real))

    @staticmethod
    def _merge_shared_prefix(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        blocks: slice | torch.Tensor,
        scale: float,
        part: torch.Tensor,
        part_lse: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """Attend every query row to the shared prefix in one SDPA call and merge with ``part``
        (the rows' attention over their own keys) into ``out``; ``blocks``: the prefix's cache
        blocks (``SharedPrefix.blocks``)."""
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        if isinstance(blocks, slice):
            kp, vp = k_cache[blocks], v_cache[blocks]
        else:
            kp, vp = k_cache.index_select(0, blocks), v_cache.index_select(0, blocks)
        kp = kp.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
        vp = vp.view(1, -1, num_kv_heads, head_dim).transpose(1, 2)
        # Rows of one KV head stacked: [1, Hkv, T * group, D].
        qq = q.view(num_tokens, num_kv_heads, group, head_dim).permute(1, 0, 2, 3)
        qq = qq.reshape(1, num_kv_heads, num_tokens * group, head_dim)
        prefix_out, prefix_lse = _sdpa_with_lse(qq, kp, vp, 0.0, False, scale=scale)
        native.merge_attention(
            prefix_out.reshape(num_kv_heads, num_tokens * group, head_dim).contiguous(),
            prefix_lse.reshape(num_kv_heads, num_tokens * group).contiguous(),
            part,
            part_lse,
            out,
        )


def _native_seqs(meta: AttentionMetadata, seqs: list[int], qlens: list[int]) -> NativeSeqs | None:
    """The native call's arguments over ``seqs`` (indices into the step's sequences, in step
    order); None for none."""
    if not seqs:
        return None
    starts = torch.tensor(meta.query_start_loc_list[:-1], dtype=torch.int64)
    lengths = torch.tensor([qlens[i] for i in seqs], dtype=torch.int64)
    if len(seqs) == meta.num_seqs:
        return NativeSeqs(
            meta.block_tables.contiguous(), meta.seq_lens.contiguous(), starts, lengths
        )
    idx = torch.tensor(seqs, dtype=torch.int64)
    return NativeSeqs(
        meta.block_tables[idx].contiguous(),
        meta.seq_lens[idx].contiguous(),
        starts[idx].contiguous(),
        lengths,
    )
