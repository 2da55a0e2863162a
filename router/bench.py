"""Micro-benchmark of the routing hot path: ``python -m router.bench``.

Prints the time of one ``PrefixAwarePolicy.rank`` call for a request of ``--blocks`` block hashes
against N replicas whose reports each hold ``--cached`` hashes (best of and median over
``--repeats`` timing runs), and the time to apply one such report.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections.abc import Callable

from router import RouterConfig, make_policy


def _time_per_call(fn: Callable[[], object], calls: int, repeats: int) -> tuple[float, float]:
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls)
    return min(runs), statistics.median(runs)


def _report(replica_id: str, hashes: list[int], at: float, load: int) -> dict[str, object]:
    return {
        "replica_id": replica_id,
        "started_at": 0.0,
        "block_size": 16,
        "num_running": load,
        "num_waiting": 0,
        "kv_free_blocks": 100,
        "kv_total_blocks": 4000,
        "cached_block_hashes": hashes,
        "reported_at": at,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=100, help="block hashes per request")
    parser.add_argument("--cached", type=int, default=3000, help="hashes per replica report")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 8, 32, 128])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    rng = random.Random(0)
    request = [rng.getrandbits(64) for _ in range(args.blocks)]
    directory = set(request)
    print(f"request: {args.blocks} blocks; each replica reports {args.cached} cached hashes")
    print(f"{'replicas':>8} {'rank best us':>13} {'median us':>10} {'per replica us':>15}"
          f" {'+directory us':>14}")  # fmt: skip
    for n in args.replicas:
        policy = make_policy("prefix_aware", RouterConfig(), rng=random.Random(0))
        names = [f"r{i}" for i in range(n)]
        for i, name in enumerate(names):
            # Replica i holds a prefix of the request of length i * blocks / n: every walk is
            # different and the longest is the whole request.
            held = request[: (i + 1) * args.blocks // n]
            filler = [rng.getrandbits(64) for _ in range(args.cached - len(held))]
            policy.apply_report(name, _report(name, held + filler, 1.0, i % 5), now=1.0)
        calls = max(10, 20000 // n)
        plain = functools.partial(policy.rank, names, request, 2.0)
        with_directory = functools.partial(policy.rank, names, request, 2.0, directory)
        best, median = _time_per_call(plain, calls, args.repeats)
        best_dir, _ = _time_per_call(with_directory, calls, args.repeats)
        print(f"{n:>8} {best * 1e6:>13.1f} {median * 1e6:>10.1f} {best / n * 1e6:>15.2f}"
              f" {best_dir * 1e6:>14.1f}")  # fmt: skip

    policy = make_policy("prefix_aware")
    hashes = [rng.getrandbits(64) for _ in range(args.cached)]
    clock = iter(range(1, 10**9))

    def apply() -> None:
        policy.apply_report("r", _report("r", hashes, float(next(clock)), 0), now=0.0)

    best, median = _time_per_call(apply, 200, args.repeats)
    print(f"apply_report ({args.cached} hashes): best {best * 1e6:.0f} us, median "
          f"{median * 1e6:.0f} us")  # fmt: skip


if __name__ == "__main__":
    main()
