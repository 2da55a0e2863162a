"""An engine replica's periodic stats line: running, waiting, KV usage, prefix hit ratio, tok/s.

Rates and the hit ratio cover the interval since the previous line. A line is written every
``interval_s`` while the replica has work or made tokens in the interval, and once more when it
goes idle; an idle replica stays quiet.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine.llm_engine import EngineStats


@dataclass(frozen=True)
class _Totals:
    at: float
    prompt_tokens: int
    generation_tokens: int
    cache_hit_tokens: int
    preemptions: int

    @staticmethod
    def of(stats: EngineStats, at: float) -> _Totals:
        return _Totals(
            at,
            stats.prompt_tokens,
            stats.generation_tokens,
            stats.cache_hit_tokens_local + stats.cache_hit_tokens_remote,
            stats.num_preemptions,
        )


class EngineStatsLog:
    """Writes the line to ``logger`` when :meth:`maybe_log` finds ``interval_s`` elapsed."""

    def __init__(self, interval_s: float, logger: logging.Logger) -> None:
        self.interval_s = interval_s
        self.logger = logger
        self._last: _Totals | None = None
        self._was_busy = False

    def maybe_log(self, stats: EngineStats, now: float | None = None) -> str | None:
        """The line written, if one was due and worth writing."""
        now = time.monotonic() if now is None else now
        totals = _Totals.of(stats, now)
        last = self._last
        if last is None:
            self._last = totals
            return None
        if now - last.at < self.interval_s:
            return None
        self._last = totals
        made = totals.generation_tokens > last.generation_tokens
        busy = stats.num_running > 0 or stats.num_waiting > 0 or made
        if not busy and not self._was_busy:
            return None
        self._was_busy = busy
        elapsed = now - last.at
        prompt = totals.prompt_tokens - last.prompt_tokens
        hits = totals.cache_hit_tokens - last.cache_hit_tokens
        line = (
            f"engine stats: running={stats.num_running} waiting={stats.num_waiting} "
            f"kv_usage={stats.kv_usage:.1%} "
            f"prefix_hit_ratio={(hits / prompt if prompt else 0.0):.1%} "
            f"prompt_tok/s={prompt / elapsed:.1f} "
            f"generation_tok/s={(totals.generation_tokens - last.generation_tokens) / elapsed:.1f} "
            f"preemptions={totals.preemptions - last.preemptions}"
        )
        self.logger.info(line)
        return line
