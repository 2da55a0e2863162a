"""Seconds to fetch a published KV object from the reader's own node vs from another node.

    python -m benchmarks.kv_fetch_nodes [--trials 5] [--objects 4] [--blocks-per-object 32]

Starts a two-node Ray cluster on this machine (as the tests do: each node has its own raylet and
object store, so an object read from the other node really crosses object stores). A publisher
actor on the head node puts objects shaped as the default model's exported KV blocks (one block
is ``[layers, 2, block_size, kv_heads, head_dim]``; bfloat16 travels as int16, as
``deployments.kv_sharing.to_numpy`` ships it). A reader on the head node and one on the second
node each fetch fresh objects (``ray.get``, what a replica's import awaits) and time every fetch.
Printed: median seconds per block from each node, their difference, and both over the profile's
prefill seconds per block (the ratios a replica reports to the routers).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from benchmarks.sim.profile import Profile

_NUMPY = {"bfloat16": np.int16, "float16": np.float16, "float32": np.float32}


def default_block_shape(block_size: int) -> tuple[int, ...]:
    """One exported block of the default model (``engine.kv_transfer.block_shape``), from its
    config alone."""
    from transformers import AutoConfig

    from engine.model.loader import DEFAULT_MODEL, resolve_model

    config = AutoConfig.from_pretrained(resolve_model(DEFAULT_MODEL))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    return (config.num_hidden_layers, 2, block_size, kv_heads, head_dim)


@ray.remote(num_cpus=0)
class Publisher:
    """Owns what it puts, as a replica owns the KV it publishes."""

    def put(self, count: int, shape: tuple[int, ...], dtype: str, seed: int) -> list[list[Any]]:
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(count):
            arr = rng.integers(-(2**14), 2**14, size=shape, dtype=np.int16).view(np.int16)
            out.append([ray.put(arr.astype(_NUMPY[dtype], copy=False))])
        return out  # refs inside lists, so Ray does not resolve them on the way


@ray.remote(num_cpus=0)
class Reader:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def fetch(self, wrapped: list[list[Any]]) -> list[float]:
        """Seconds of each fetch; the arrays are dropped at once."""
        seconds = []
        for (ref,) in wrapped:
            started = time.perf_counter()
            arr = ray.get(ref)
            seconds.append(time.perf_counter() - started)
            del arr
        return seconds


def _on(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--objects", type=int, default=4, help="objects fetched per reader per trial")
    p.add_argument("--blocks-per-object", type=int, default=32,
                   help="as kv_sharing.max_blocks_per_object")  # fmt: skip
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(_NUMPY), default="bfloat16")
    p.add_argument("--object-store-mb", type=int, default=256, help="per node")
    args = p.parse_args(argv)
    from ray.cluster_utils import Cluster

    shape = (args.blocks_per_object, *default_block_shape(args.block_size))
    node_args = {"num_cpus": 2, "object_store_memory": args.object_store_mb << 20}
    cluster = Cluster(
        initialize_head=True, head_node_args={**node_args, "include_dashboard": False}
    )
    cluster.add_node(**node_args)
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        head = ray.get_runtime_context().get_node_id()
        other = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head)
        publisher = Publisher.options(scheduling_strategy=_on(head)).remote()
        readers = {
            "same_node": Reader.options(scheduling_strategy=_on(head)).remote(),
            "cross_node": Reader.options(scheduling_strategy=_on(other)).remote(),
        }
        assert ray.get(readers["cross_node"].node.remote()) == other
        samples: dict[str, list[float]] = {k: [] for k in readers}
        for trial in range(args.trials + 1):  # the first is a warm-up, not counted
            for i, (kind, reader) in enumerate(readers.items()):
                wrapped = ray.get(
                    publisher.put.remote(args.objects, shape, args.dtype, trial * 2 + i)
                )
                seconds = ray.get(reader.fetch.remote(wrapped))
                if trial:
                    samples[kind].extend(seconds)
                del wrapped
    finally:
        ray.shutdown()
        cluster.shutdown()
    block_bytes = int(np.prod(shape[1:])) * np.dtype(_NUMPY[args.dtype]).itemsize
    per_block = {k: statistics.median(v) / args.blocks_per_object for k, v in samples.items()}
    prefill = Profile.load()
    prefill_s_per_block = prefill.step.prefill_token_s * args.block_size
    result = {
        "block_shape": list(shape[1:]),
        "dtype": args.dtype,
        "block_bytes": block_bytes,
        "object_bytes": block_bytes * args.blocks_per_object,
        "fetches_per_kind": len(samples["same_node"]),
        "same_node_s_per_block": per_block["same_node"],
        "cross_node_s_per_block": per_block["cross_node"],
        "cross_node_extra_s_per_block": per_block["cross_node"] - per_block["same_node"],
        "profile": prefill.name,
        "prefill_s_per_block": prefill_s_per_block,
        "same_node_ratio": per_block["same_node"] / prefill_s_per_block,
        "cross_node_ratio": per_block["cross_node"] / prefill_s_per_block,
    }
    print(
        f"{args.blocks_per_object}-block objects of {block_bytes / 1024:.0f} KiB blocks: "
        f"same node {per_block['same_node'] * 1e3:.3f} ms/block, "
        f"cross node {per_block['cross_node'] * 1e3:.3f} ms/block "
        f"(median of {result['fetches_per_kind']} fetches each); ratios to prefill "
        f"{result['same_node_ratio']:.3f} / {result['cross_node_ratio']:.3f}"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
