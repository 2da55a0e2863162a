"""Queue order as an ordered tuple of scorers.

A policy names the request attributes that order the waiting queue (and the running batch), most
significant first; the scheduler compares the tuples, so a smaller key is more urgent. Every
scorer reads a value that is fixed for the life of a request, so a key computed once stays
valid while the request waits, runs, is preempted and waits again. Ties that survive every
scorer fall back to the order in which the queue first saw the request.

The same key picks preemption victims: the running request with the largest key goes first, so
under ``deadline`` that is the lowest-priority request with the latest deadline.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from engine.config import SchedulingPolicy
from engine.request import Request

Scorer = Callable[[Request], float]

SCORERS: dict[str, Scorer] = {
    "arrival": lambda r: r.arrival_time,
    # vLLM's convention: a lower value is more urgent.
    "priority": lambda r: r.priority,
    # A request without a deadline sorts after every request that has one.
    "deadline": lambda r: math.inf if r.deadline is None else r.deadline,
    "prompt_len": lambda r: r.num_prompt_tokens,
}

POLICIES: dict[str, tuple[str, ...]] = {
    "fcfs": ("arrival",),
    "priority": ("priority", "arrival"),
    # Earliest deadline first within a priority class: ``priority`` is the latency class.
    "deadline": ("priority", "deadline", "arrival"),
    "shortest_prompt": ("prompt_len", "arrival"),
}


def policy_scorers(policy: SchedulingPolicy | tuple[str, ...]) -> tuple[Scorer, ...]:
    """The scorers of a named policy, or of an explicit tuple of scorer names."""
    names = POLICIES.get(policy) if isinstance(policy, str) else policy
    if names is None:
        raise ValueError(f"scheduling_policy: unknown policy {policy!r}")
    unknown = [n for n in names if n not in SCORERS]
    if unknown or not names:
        raise ValueError(
            f"scheduling_policy: scorers must be among {sorted(SCORERS)}, got {list(names)}"
        )
    return tuple(SCORERS[n] for n in names)


def uses_priority(policy: SchedulingPolicy) -> bool:
    """Whether the policy orders requests by ``priority`` at all."""
    return "priority" in POLICIES[policy]
