"""The reference hit ratio: one ideal LRU cache in front of the whole cluster.

Definition. One cache of ``capacity_blocks`` blocks (the cluster's total: replicas x per-replica
capacity; None = unbounded) sees every request once, in arrival order, and serves it instantly:

1. its hit is the longest run of the request's full prompt blocks, from block 0, that the cache
   holds, capped at ``(prompt_len - 1) // block_tokens`` blocks (the engine recomputes at least
   the last prompt token), counted in tokens;
2. then every full prompt block of the request is inserted or refreshed, the last block first,
   so that block 0 is the most recently used (the engine's eviction order: a request's tail
   blocks go first);
3. least recently used blocks are evicted down to the capacity.

It has no concurrency (no request waits for another's prefill, no block is pinned by a running
request), holds no generated-token blocks, and is not split across replicas: what a perfectly
shared cache of the same total size would achieve with plain LRU. (It is not an upper bound in
the strict sense, since LRU is not optimal, but a policy rarely beats it.) The ratio is
``sum(hit tokens) / sum(prompt tokens)``, the same as the simulated and live hit ratios.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from benchmarks.sim.profile import Profile
from benchmarks.sim.trace import SimRequestSpec


def ideal_hits(
    specs: Iterable[SimRequestSpec], capacity_blocks: int | None, block_tokens: int
) -> Iterator[tuple[SimRequestSpec, int]]:
    """Each request with its hit in the ideal single LRU cache (in tokens), in the given order."""
    lru: OrderedDict[int, None] = OrderedDict()
    for spec in specs:
        hashes = spec.block_hashes
        usable = min(len(hashes), (spec.prompt_len - 1) // block_tokens)
        hits = 0
        while hits < usable and hashes[hits] in lru:
            hits += 1
        yield spec, hits * block_tokens
        for h in reversed(hashes):
            lru[h] = None
            lru.move_to_end(h)
        if capacity_blocks is not None:
            while len(lru) > capacity_blocks:
                lru.popitem(last=False)


def ideal_hit_ratio(
    specs: Iterable[SimRequestSpec], capacity_blocks: int | None, block_tokens: int
) -> float:
    """Hit ratio of the ideal single LRU cache defined in the module docstring."""
    hit_tokens = 0
    prompt_tokens = 0
    for spec, hit in ideal_hits(specs, capacity_blocks, block_tokens):
        prompt_tokens += spec.prompt_len
        hit_tokens += hit
    return hit_tokens / prompt_tokens if prompt_tokens else 0.0


def ttft_floors_s(
    specs: Iterable[SimRequestSpec],
    capacity_blocks: int | None,
    block_tokens: int,
    profile: Profile,
) -> list[float]:
    """Each request's time to first token with the whole of an idle replica to itself and the
    ideal cache's hit: its uncached prompt prefilled in chunks of the profile's token budget,
    one step per chunk, nothing else in the batch. Queueing and shared steps only add to it, so
    no policy gives a request less unless it beats the ideal cache's hit (LRU is not optimal,
    which a policy rarely exploits): the floor's percentiles bound what routing can reach on the
    trace with these replicas."""
    cost = profile.step
    budget = profile.max_num_batched_tokens
    floors = []
    for spec, hit in ideal_hits(specs, capacity_blocks, block_tokens):
        done = hit
        total = 0.0
        while done < spec.prompt_len:
            n = min(budget, spec.prompt_len - done)
            total += cost.step_s(n, n * (done + (n + 1) / 2), 0, 0)
            done += n
        floors.append(total)
    return floors
