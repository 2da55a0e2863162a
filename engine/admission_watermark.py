"""The adaptive admission watermark: how full the KV pool may get through admission.

Admission of a new request may fill the pool up to ``level`` blocks in use; running requests
may grow past it (decode never waits on the watermark). ``level`` starts at ``base``, the pool
less the configured ``watermark`` fraction, and adapts:

* after a step that had to preempt, it drops to the blocks in use once the victims left, so the
  victims and everyone behind them wait until running requests give blocks back, instead of
  being readmitted into the same shortage and preempted again;
* each finishing (or aborted) request raises it by the blocks its release freed, up to ``base``.

Invariant: ``0 <= level <= base <= num_blocks``. ``reserve`` (blocks admission leaves free) is
``num_blocks - level``: the figure ``KVCacheManager.allocate_slots`` checks. With nothing
running the scheduler admits regardless, so a low level never deadlocks an idle engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AdmissionWatermark:
    num_blocks: int
    base: int
    adaptive: bool = True
    level: int = field(init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.base <= self.num_blocks:
            raise ValueError(f"base: must be in [0, {self.num_blocks}], got {self.base}")
        self.level = self.base

    @classmethod
    def for_pool(cls, num_blocks: int, watermark: float, adaptive: bool) -> AdmissionWatermark:
        return cls(num_blocks, num_blocks - int(watermark * num_blocks), adaptive)

    @property
    def reserve(self) -> int:
        """Free blocks that admitting a new request must leave."""
        return self.num_blocks - self.level

    def reset(self) -> None:
        self.level = self.base

    def on_preemption(self, blocks_in_use: int) -> None:
        if self.adaptive:
            self.level = max(0, min(self.level, blocks_in_use))

    def on_release(self, freed_blocks: int) -> None:
        if self.adaptive and freed_blocks > 0:
            self.level = min(self.base, self.level + freed_blocks)
