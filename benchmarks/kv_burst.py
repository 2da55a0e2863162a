"""A burst of requests sharing one long prefix that another replica published: fetches and memory.

    python -m benchmarks.kv_burst [--prefix-len 1024] [--burst 32] [--dtype auto] [--rounds 3]

Starts a local Ray instance. An owner engine in an actor of its own computes and publishes the
prefix to a real KV directory actor through Ray's object store; then ``--burst`` concurrent
requests (the prefix plus distinct suffixes) reach a fresh importer engine in this process, as
they would a replica. Each
round measures, on a fresh importer, the peak growth of the process's resident memory during
the burst (sampled every 2 ms from /proc) twice: with KV sharing (the importer fetches the
prefix) and without (it recomputes it). The difference is what importing costs in memory on top
of computing; single-flight fetches keep it near one copy of the prefix's KV, where one private
copy per request would be ``--burst`` copies. Also printed: fetches per burst and the burst's
wall time. Linux only (reads /proc/self/status).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import threading
import time
from typing import Any

import ray

from deployments.config import KVSharingArgs
from deployments.kv_directory import KVDirectory
from deployments.kv_sharing import HeldDirectory, KVSharing
from deployments.metrics import ReplicaMetrics
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class PeakRSS:
    """Samples resident memory in a thread; ``growth`` is the peak over the start value."""

    def __init__(self) -> None:
        self.start = rss_bytes()
        self.peak = self.start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.start


def replica(config: EngineConfig, name: str, directory: HeldDirectory) -> KVSharing:
    async_engine = AsyncEngine(LLMEngine(config))
    sharing = KVSharing(name, async_engine, KVSharingArgs(), directory, ReplicaMetrics(name))
    async_engine.start()
    return sharing


async def run(sharing: KVSharing, rid: str, prompt: list[int], share: bool) -> None:
    fetched = None
    if share:
        hashes = sharing.engine.make_request(rid, prompt, PARAMS).block_hashes
        fetched = await sharing.prefetch(len(prompt), hashes)
    async for _ in sharing.async_engine.generate(rid, prompt, PARAMS, kv_transfer=fetched):
        pass


@ray.remote(num_cpus=0)
class Owner:
    """The publishing replica, in a process of its own (its object store pages are not ours)."""

    def __init__(self, config: EngineConfig, directory: Any) -> None:
        self.sharing = replica(config, "owner", HeldDirectory(directory))

    async def publish(self, prefix: list[int]) -> None:
        self.sharing.start()
        if not hasattr(self, "_heartbeats"):
            # A replica heartbeats through its reporter; without it the directory would drop
            # this owner's entries after owner_timeout_s.
            self._heartbeats = asyncio.get_running_loop().create_task(self._heartbeat())
        await run(self.sharing, f"seed{len(prefix)}-{prefix[0]}", [*prefix, 7], share=False)
        hashes = self.sharing.engine.make_request("probe", prefix, PARAMS).block_hashes
        while await self.sharing.directory.contains.remote(hashes) < len(hashes):
            await asyncio.sleep(0.05)

    async def _heartbeat(self) -> None:
        while True:
            await self.sharing.heartbeat()
            await asyncio.sleep(1.0)


async def burst(sharing: KVSharing, prompts: list[list[int]], share: bool) -> dict[str, float]:
    with PeakRSS() as rss:
        start = time.perf_counter()
        await asyncio.gather(*(run(sharing, f"b{i}", p, share) for i, p in enumerate(prompts)))
        wall = time.perf_counter() - start
    return {"rss_growth_mb": rss.growth / 2**20, "wall_s": wall}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--burst", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    ray.init(
        address="local",
        num_cpus=1,
        object_store_memory=1 << 30,
        include_dashboard=False,
        log_to_driver=False,
    )
    directory_actor = KVDirectory.remote(capacity_bytes=1 << 30)
    directory = HeldDirectory(directory_actor)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_memory_gb=1.0,
        max_num_seqs=args.burst,
        kv_hash_key="benchmark-key-0123456789",
    )
    owner = Owner.remote(config, directory_actor)
    probe = LLMEngine(config.replace(num_kv_blocks=1))
    dtype = probe.dtype
    block_nbytes = probe.model_cfg.kv_bytes_per_block(config.block_size, dtype)
    vocab = probe.model_cfg.vocab_size
    del probe
    rng = random.Random(0)
    rows: list[dict[str, float]] = []

    async def one_round() -> dict[str, float]:
        prefix = [rng.randrange(100, vocab) for _ in range(args.prefix_len)]
        prompts = [
            prefix + [rng.randrange(100, vocab) for _ in range(16)] for _ in range(args.burst)
        ]
        await owner.publish.remote(prefix)
        out: dict[str, float] = {}
        for share in (False, True):
            importer = replica(config, f"importer{len(rows)}{share}", directory)
            try:
                result = await burst(importer, prompts, share)
            finally:
                importer.async_engine.shutdown()
            key = "import" if share else "recompute"
            out[f"{key}_rss_growth_mb"] = result["rss_growth_mb"]
            out[f"{key}_wall_s"] = result["wall_s"]
            if share:
                for name in ("fetches", "imported", "import_failures", "rejected", "skipped"):
                    out[name] = getattr(importer, name)._value.get()
        return out

    try:
        for _ in range(args.rounds):
            rows.append(asyncio.run(one_round()))
    finally:
        ray.shutdown()
    copy_mb = block_nbytes * (args.prefix_len // config.block_size) / 2**20
    summary = {
        "model": args.model,
        "dtype": str(dtype).removeprefix("torch."),
        "prefix_len": args.prefix_len,
        "burst": args.burst,
        "one_copy_mb": round(copy_mb, 1),
        **{f"median_{k}": round(statistics.median(r[k] for r in rows), 3) for k in rows[0]},
        "rounds": rows,
    }
    summary["median_extra_mb_for_import"] = round(
        summary["median_import_rss_growth_mb"] - summary["median_recompute_rss_growth_mb"], 1
    )
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
