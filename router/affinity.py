"""Bounded memories the prefix-aware policy keeps beside the replica views: where each session's
last turn went, and how often each cached prefix is asked for; and a session's home replica, which
needs no memory at all.

Both are plain LRU tables (``collections.OrderedDict``) capped at a configured number of keys, so
the router's memory stays bounded however many sessions or prefixes pass through it. Neither
reads a clock: times are passed in, on the clock of ``router.state``.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SessionTurn:
    """Where a session's latest turn was sent, and how many full prompt blocks it had."""

    replica_id: str
    prompt_blocks: int


class SessionTable:
    """Session key -> its latest ``SessionTurn``, least recently routed evicted first.

    Invariant: at most ``capacity`` sessions are held; ``get`` does not refresh a session (only
    routing a turn does), so a session that stopped sending ages out.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity: must be >= 0, got {capacity}")
        self.capacity = capacity
        self._turns: OrderedDict[str, SessionTurn] = OrderedDict()

    def __len__(self) -> int:
        return len(self._turns)

    def get(self, session: str | None) -> SessionTurn | None:
        return None if session is None else self._turns.get(session)

    def record(self, session: str, replica_id: str, prompt_blocks: int) -> None:
        if self.capacity == 0:
            return
        self._turns[session] = SessionTurn(replica_id, prompt_blocks)
        self._turns.move_to_end(session)
        while len(self._turns) > self.capacity:
            self._turns.popitem(last=False)


class RecentSessions:
    """The replica's side of session affinity: the sessions whose requests it served lately, with
    each one's latest prompt length in blocks, for its routing-stats report (``recent_sessions``).
    Routers that did not route those turns learn from it where the sessions are.

    Invariant: at most ``capacity`` sessions are held, least recently served dropped first;
    ``snapshot`` lists only those served within ``window_s`` of ``now``, oldest first.
    """

    def __init__(self, capacity: int, window_s: float) -> None:
        if capacity < 0 or not window_s > 0:
            raise ValueError("capacity must be >= 0 and window_s > 0")
        self.capacity = capacity
        self.window_s = window_s
        self._seen: OrderedDict[str, tuple[int, float]] = OrderedDict()

    def touch(self, session: str, prompt_blocks: int, now: float) -> None:
        if self.capacity == 0:
            return
        self._seen[session] = (prompt_blocks, now)
        self._seen.move_to_end(session)
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def snapshot(self, now: float) -> list[tuple[str, int]]:
        since = now - self.window_s
        return [(s, blocks) for s, (blocks, at) in self._seen.items() if at >= since]


def rendezvous_home(key: bytes, candidates: Sequence[str]) -> str | None:
    """The candidate with the highest rendezvous (highest-random-weight) score for ``key``; None
    without candidates.

    Why: a deployment can run several routers (Serve starts one beside each proxy node's HAProxy,
    which round-robins over them), and each remembers only the requests it routed itself. Every
    router computes the same home from the same candidates, in any order (the score is a BLAKE2
    digest, not Python's per-process salted ``hash``), and adding or removing a replica moves
    only the keys whose home it becomes or was."""
    best: tuple[bytes, str] | None = None
    tail = b"\0" + key
    for replica_id in candidates:
        score = hashlib.blake2b(replica_id.encode() + tail, digest_size=8).digest()
        if best is None or (score, replica_id) > best:
            best = (score, replica_id)
    return None if best is None else best[1]


def session_home(session: str, candidates: Sequence[str]) -> str | None:
    """Where a session's turns go when this router has no memory of the session."""
    return rendezvous_home(b"s" + session.encode("utf-8", "surrogatepass"), candidates)


def prefix_home(first_block_hash: int, candidates: Sequence[str]) -> str | None:
    """Where a prompt no replica is known to hold goes when loads allow: keyed by its first
    block, so requests sharing a system prompt meet on one replica whichever router sends them."""
    return rendezvous_home(b"p%d" % first_block_hash, candidates)


class PrefixHeat:
    """Request rate per prefix (keyed by the chained hash of its last block), as an exponentially
    decaying count: each request adds ``1 / window_s`` and the figure decays by ``e`` every
    ``window_s``, so a steady stream of ``x`` requests per second reads ``x``.

    Invariant: at most ``capacity`` prefixes are tracked; touching one makes it the most recent.
    """

    def __init__(self, capacity: int, window_s: float) -> None:
        if capacity < 0 or not window_s > 0:
            raise ValueError("capacity must be >= 0 and window_s > 0")
        self.capacity = capacity
        self.window_s = window_s
        self._rates: OrderedDict[int, tuple[float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rates)

    def rate(self, key: int, now: float) -> float:
        """Requests per second for ``key`` at ``now`` (0 if unknown)."""
        entry = self._rates.get(key)
        if entry is None:
            return 0.0
        rate, at = entry
        return rate * math.exp(-max(0.0, now - at) / self.window_s)

    def touch(self, key: int, now: float) -> float:
        """Count one request for ``key`` at ``now``; returns the updated rate."""
        if self.capacity == 0:
            return 0.0
        rate = self.rate(key, now) + 1.0 / self.window_s
        self._rates[key] = (rate, now)
        self._rates.move_to_end(key)
        while len(self._rates) > self.capacity:
            self._rates.popitem(last=False)
        return rate
