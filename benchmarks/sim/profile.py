"""A replica's cost profile: how long one engine step takes, as fitted by ``benchmarks.calibrate``.

The simulator charges each step of a replica the time this model predicts for the step's batch::

    step_s = base_s
           + prefill_token_s    * (prompt tokens computed in the step, over every prefill chunk)
           + prefill_pair_s     * (attention pairs of those chunks: chunk * (context + chunk / 2))
           + decode_seq_s       * (sequences decoding one token)
           + decode_ctx_token_s * (context tokens those decodes attend to, summed)

An affine model of prefill work plus an affine model of decode batch size, with one attention term
each, since a chunk's attention grows with its context. Every coefficient is >= 0 (the fit
enforces it), so a step never costs less than ``base_s``.

KV sharing: importing ``n`` blocks from the shared directory delays the request's admission by
``transfer_base_s + n * transfer_block_s`` (per blocks of ``block_size`` tokens; the simulator
scales it to its own block size). Blocks published on another node cost
``transfer_cross_node_block_s`` each instead (default: ``transfer_block_s`` plus the extra a
fetch across object stores measured, ``CROSS_NODE_EXTRA_BLOCK_S``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

FEATURES = ("base_s", "prefill_token_s", "prefill_pair_s", "decode_seq_s", "decode_ctx_token_s")
DEFAULT_PROFILE = Path(__file__).resolve().parent.parent / "profiles" / "cpu-smollm2-bf16.json"
# Seconds a fetch of one 16-token block of the default model (bf16, 360 KiB) takes on top of a
# same-node read when the object lives in another node's object store (``python -m
# benchmarks.kv_fetch_nodes``; docs/kv_sharing.md has the measurement).
CROSS_NODE_EXTRA_BLOCK_S = 0.45e-3


@dataclass(frozen=True)
class StepCost:
    """Coefficients of the step-time model (seconds per unit); all >= 0."""

    base_s: float
    prefill_token_s: float
    prefill_pair_s: float = 0.0
    decode_seq_s: float = 0.0
    decode_ctx_token_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int | float) or value < 0:
                raise ValueError(f"step cost {f.name}: must be a number >= 0, got {value!r}")

    def step_s(
        self, prefill_tokens: int, prefill_pairs: float, decode_seqs: int, decode_ctx: int
    ) -> float:
        return (
            self.base_s
            + self.prefill_token_s * prefill_tokens
            + self.prefill_pair_s * prefill_pairs
            + self.decode_seq_s * decode_seqs
            + self.decode_ctx_token_s * decode_ctx
        )

    def as_vector(self) -> list[float]:
        return [getattr(self, name) for name in FEATURES]


@dataclass(frozen=True)
class Profile:
    """Everything the simulator needs to know about one engine replica.

    ``block_size`` is the engine block (tokens) the transfer costs refer to; ``kv_capacity_tokens``
    the KV cache size of one replica in tokens (the default simulated capacity);
    ``max_num_batched_tokens`` / ``max_num_seqs`` / ``watermark`` the scheduler's limits as served.
    ``meta`` records how the profile was measured (machine, load, date, raw samples, fit quality).
    """

    name: str
    step: StepCost
    block_size: int = 16
    kv_capacity_tokens: int = 2912 * 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    watermark: float = 0.01
    transfer_base_s: float = 0.0
    transfer_block_s: float = 0.0
    transfer_cross_node_block_s: float | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def cross_node_block_s(self) -> float:
        """Seconds to import one block (of ``block_size`` tokens) published on another node."""
        if self.transfer_cross_node_block_s is not None:
            return self.transfer_cross_node_block_s
        return self.transfer_block_s + CROSS_NODE_EXTRA_BLOCK_S * self.block_size / 16

    def transfer_s(self, num_blocks: int, block_tokens: int, cross_node_blocks: int = 0) -> float:
        """Time to import ``num_blocks`` simulated blocks of ``block_tokens`` tokens each, of
        which ``cross_node_blocks`` were published on another node."""
        if num_blocks <= 0:
            return 0.0
        scale = block_tokens / self.block_size
        if not cross_node_blocks:  # the arithmetic of a single-node cluster, unchanged
            return self.transfer_base_s + self.transfer_block_s * num_blocks * scale
        local = num_blocks - cross_node_blocks
        return self.transfer_base_s + scale * (
            self.transfer_block_s * local + self.cross_node_block_s * cross_node_blocks
        )

    def transfer_cost_ratios(self) -> tuple[float, float]:
        """``(same_node, cross_node)``: seconds to import a block over seconds to prefill one,
        what a live replica reports once it has measured both."""
        prefill = self.step.prefill_token_s * self.block_size
        if prefill <= 0:
            raise ValueError("profile: prefill_token_s must be > 0 to price imports")
        return self.transfer_block_s / prefill, self.cross_node_block_s / prefill

    def __post_init__(self) -> None:
        cross = self.transfer_cross_node_block_s
        if cross is not None and (not isinstance(cross, int | float) or cross < 0):
            raise ValueError(f"profile transfer_cross_node_block_s: must be >= 0, got {cross!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Profile:
        data = dict(data)
        step = data.pop("step")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"profile: unknown key(s) {', '.join(unknown)}")
        return cls(step=StepCost(**step), **data)

    @classmethod
    def load(cls, path: str | Path = DEFAULT_PROFILE) -> Profile:
        return cls.from_json(json.loads(Path(path).read_text(encoding="utf-8")))

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n", encoding="utf-8")
