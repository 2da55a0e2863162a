"""Time to first token when a long prefix is imported from another replica vs recomputed.

    python -m benchmarks.kv_import [--prefix-len 1024] [--trials 5]

Starts the service with round-robin routing and KV sharing on (2 replicas). Each trial sends a
fresh prompt (prefix + a short suffix) to one replica, which computes and publishes it, then sends
the same prompt again until another replica serves it, importing the prefix from the object
store. A fresh prompt of the same length measures the cold (recompute) TTFT. TTFT is measured at
the client over streaming HTTP with ``max_tokens=1``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import httpx

from benchmarks.service import TWO_REPLICAS, config_variant, running_service


def ttft(client: httpx.Client, url: str, prompt: list[int]) -> dict[str, Any]:
    body = {
        "model": "smollm2-135m-instruct",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    usage = None
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        replica = r.headers["x-engine-replica"]
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and first is None:
                first = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {
        "ttft_s": first,
        "replica": replica,
        "cached": usage["prompt_tokens_details"]["cached_tokens"] if usage else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=8)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)

    def prompt() -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(args.prefix_len + args.suffix_len)]

    config = config_variant(
        {"routing_policy": "round_robin", "kv_sharing": {"enabled": True}}, TWO_REPLICAS
    )
    imported, recomputed = [], []
    with running_service(config, port=args.port) as url, httpx.Client(timeout=300) as client:
        ttft(client, url, prompt())  # warm both code paths once
        ttft(client, url, prompt())
        for _ in range(args.trials):
            recomputed.append(ttft(client, url, prompt()))
            shared = prompt()
            owner = ttft(client, url, shared)
            time.sleep(1.0)  # let the owner publish its blocks
            for _ in range(4):
                warm = ttft(client, url, shared)
                if warm["replica"] != owner["replica"]:
                    break
            assert warm["cached"] >= args.prefix_len // 16 * 16, warm
            imported.append(warm)
    imp = statistics.median(r["ttft_s"] for r in imported)
    rec = statistics.median(r["ttft_s"] for r in recomputed)
    result = {
        "prefix_len": args.prefix_len,
        "trials": args.trials,
        "ttft_imported_ms": [round(r["ttft_s"] * 1000, 1) for r in imported],
        "ttft_recomputed_ms": [round(r["ttft_s"] * 1000, 1) for r in recomputed],
        "median_imported_ms": round(imp * 1000, 1),
        "median_recomputed_ms": round(rec * 1000, 1),
        "speedup": round(rec / imp, 2),
        "cached_tokens_imported": [r["cached"] for r in imported],
    }
    print(
        f"TTFT, {args.prefix_len}-token prefix: imported {imp * 1000:.0f} ms, "
        f"recomputed {rec * 1000:.0f} ms (median of {args.trials}): {rec / imp:.1f}x"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
