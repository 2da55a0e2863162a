"""Measure our engine's step times and fit the simulator's cost profile.

    python -m benchmarks.calibrate --out benchmarks/profiles/cpu-smollm2-bf16.json

Drives ``engine.LLMEngine.step()`` directly (the offline ``LLM``'s engine) and times single steps:

- prefill: one request of ``L`` uncached tokens, alone in its step (``L`` up to the token budget),
  and the same with ``C`` tokens of context already cached (a prefix hit), which adds attention;
- decode: ``b`` requests of ``c`` context tokens each, all decoding one token per step;
- mixed steps (decodes plus a prefill chunk), used only to check that the fitted model adds up.

It then fits :class:`benchmarks.sim.profile.StepCost` (non-negative, weighted least squares so
that relative errors count equally for short and long steps) and measures the cost of installing
imported KV blocks (``engine.kv_transfer.import_blocks`` after rebuilding the tensor from numpy, as
a replica importing from the KV directory does). The profile records the machine, its load
average before and after, and every sample. Run it when the machine is quiet (``--wait-load``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.sim.profile import DEFAULT_PROFILE, FEATURES, Profile, StepCost

PREFILL_LENGTHS = (16, 64, 128, 256, 512, 1024, 1536, 2048)
PREFILL_WITH_CONTEXT = ((128, 1024), (128, 4096), (512, 2048), (512, 4096), (1024, 4096))
DECODE_POINTS = tuple((b, c) for c in (32, 512) for b in (1, 2, 4, 8, 16, 32, 64)) + (
    (1, 2048),
    (4, 2048),
    (1, 4096),
    (4, 4096),
)
MIXED_POINTS = ((4, 256, 256), (16, 512, 512), (32, 128, 1024))  # (decodes, their ctx, chunk)
TRANSFER_BLOCKS = (8, 32, 128)


@dataclass(frozen=True)
class StepSample:
    """One timed step and its features (see ``benchmarks.sim.profile`` for their meaning)."""

    kind: str
    prefill_tokens: int
    prefill_pairs: float
    decode_seqs: int
    decode_ctx: int
    seconds: float

    def features(self) -> list[float]:
        return [1.0, self.prefill_tokens, self.prefill_pairs, self.decode_seqs, self.decode_ctx]


def prefill_pairs(chunk: int, context: int) -> float:
    """Attention (query, key) pairs of a causal chunk of ``chunk`` tokens after ``context``."""
    return chunk * (context + (chunk + 1) / 2)


def fit_step_cost(samples: Sequence[StepSample]) -> StepCost:
    """Non-negative least squares on relative error: each row is weighted by ``1 / seconds``.

    A coefficient that comes out negative is pinned to 0 and the rest refitted, until all are
    non-negative (the active-set idea of NNLS, enough for five features)."""
    if not samples:
        raise ValueError("no samples to fit")
    x = np.array([s.features() for s in samples], dtype=float)
    y = np.array([s.seconds for s in samples], dtype=float)
    w = 1.0 / np.maximum(y, 1e-9)
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0.0
            coef[active] = sol
            break
        active = [a for a, v in zip(active, sol, strict=True) if v >= 0]
    return StepCost(**{name: float(v) for name, v in zip(FEATURES, coef, strict=True)})


def best_of(samples: Sequence[StepSample]) -> list[StepSample]:
    """The fastest of the repeats of each measured point. On a shared machine other processes
    only ever slow a step down, so the minimum is the best estimate of the engine's own time."""
    best: dict[tuple[Any, ...], StepSample] = {}
    for s in samples:
        key = (s.kind, s.prefill_tokens, s.prefill_pairs, s.decode_seqs, s.decode_ctx)
        if key not in best or s.seconds < best[key].seconds:
            best[key] = s
    return list(best.values())


def fit_quality(cost: StepCost, samples: Sequence[StepSample]) -> dict[str, float]:
    """Relative errors of the fitted model on ``samples`` (median, p90, max) and R^2."""
    if not samples:
        return {}
    y = np.array([s.seconds for s in samples])
    pred = np.array(
        [
            cost.step_s(s.prefill_tokens, s.prefill_pairs, s.decode_seqs, s.decode_ctx)
            for s in samples
        ]
    )
    rel = np.abs(pred - y) / y
    ss_res = float(((pred - y) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return {
        "rel_err_median": float(np.median(rel)),
        "rel_err_p90": float(np.percentile(rel, 90)),
        "rel_err_max": float(rel.max()),
        "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
    }


# --- measuring -------------------------------------------------------------------------------


class _Engine:
    """A thin wrapper that feeds fresh random prompts and times single engine steps."""

    def __init__(self, engine: Any, seed: int = 0) -> None:
        from engine.sampling_params import SamplingParams

        self.engine = engine
        self.params = SamplingParams
        self.rng = np.random.default_rng(seed)
        self.vocab = engine.model_cfg.vocab_size
        self.ids = 0

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(100, self.vocab - 100, size=n).tolist()

    def add(self, prompt: list[int], max_tokens: int) -> str:
        self.ids += 1
        rid = f"cal-{self.ids}"
        params = self.params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(rid, prompt, params)
        return rid

    def timed_step(self) -> float:
        start = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - start

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def fit_samples(samples: Sequence[StepSample]) -> tuple[StepCost, dict[str, Any]]:
    """The profile's fit: :func:`fit_step_cost` over the best of each point's repeats, mixed
    steps left out; and its quality, on those points (``fit``) and on the held-out mixed steps
    (``mixed_check``)."""
    fitted = best_of([s for s in samples if s.kind != "mixed"])
    cost = fit_step_cost(fitted)
    quality = {
        "fit": fit_quality(cost, fitted),
        "mixed_check": fit_quality(cost, best_of([s for s in samples if s.kind == "mixed"])),
    }
    return cost, quality


def measure_prefill(e: _Engine, repeats: int) -> list[StepSample]:
    samples = []
    for _ in range(repeats):
        for n in PREFILL_LENGTHS:
            e.add(e.tokens(n), max_tokens=1)
            t = e.timed_step()
            e.drain()
            samples.append(StepSample("prefill", n, prefill_pairs(n, 0), 0, 0, t))
        for n, ctx in PREFILL_WITH_CONTEXT:
            prefix = e.tokens(ctx)
            e.add(prefix + e.tokens(16), max_tokens=1)  # caches the prefix's blocks
            e.drain()
            e.add(prefix + e.tokens(n), max_tokens=1)
            t = e.timed_step()
            e.drain()
            samples.append(StepSample("prefill_ctx", n, prefill_pairs(n, ctx), 0, 0, t))
    return samples


def _start_decoders(e: _Engine, batch: int, ctx: int, steps: int) -> None:
    for _ in range(batch):
        e.add(e.tokens(ctx), max_tokens=steps + 2)
    # Run until every prompt is prefilled and has sampled its first token.
    while any(r.num_output_tokens == 0 for r in e.engine.scheduler.requests.values()):
        e.engine.step()


def measure_decode(e: _Engine, repeats: int, steps: int = 4) -> list[StepSample]:
    samples = []
    for _ in range(repeats):
        for batch, ctx in DECODE_POINTS:
            _start_decoders(e, batch, ctx, steps)
            for k in range(steps):
                # Context attended by each decode: prompt + outputs so far (+ the new token).
                t = e.timed_step()
                samples.append(StepSample("decode", 0, 0.0, batch, batch * (ctx + k + 1), t))
            e.drain()
    return samples


def measure_mixed(e: _Engine, repeats: int) -> list[StepSample]:
    samples = []
    for _ in range(repeats):
        for batch, ctx, chunk in MIXED_POINTS:
            _start_decoders(e, batch, ctx, steps=3)
            e.add(e.tokens(chunk), max_tokens=1)
            t = e.timed_step()
            samples.append(
                StepSample("mixed", chunk, prefill_pairs(chunk, 0), batch, batch * (ctx + 1), t)
            )
            e.drain()
    return samples


def measure_transfer(e: _Engine, repeats: int) -> dict[str, Any]:
    """Seconds to rebuild ``n`` blocks from numpy and install them (an importer's work)."""
    import torch

    from deployments.kv_sharing import from_numpy, to_numpy
    from engine.block_hash import compute_block_hashes
    from engine.kv_transfer import import_blocks

    engine = e.engine
    bs = engine.block_size
    rows = []
    for _ in range(repeats):
        for n in TRANSFER_BLOCKS:
            prompt = e.tokens(n * bs + 1)
            e.add(prompt, max_tokens=1)
            e.drain()
            request_hashes = compute_block_hashes(prompt, bs, engine.hash_root())
            found, kv = engine.export_prefix(request_hashes[:n])
            arr = to_numpy(kv)
            fresh = [int(h) ^ 0x5A5A5A5A5A5A5A5A for h in found]
            start = time.perf_counter()
            kv_in = torch.stack([from_numpy(arr[i], engine.dtype) for i in range(len(fresh))])
            import_blocks(engine.kv, engine.runner, fresh, kv_in)
            rows.append((len(fresh), time.perf_counter() - start))
    x = np.array([[1.0, n] for n, _ in rows])
    y = np.array([t for _, t in rows])
    (base, per_block), *_ = np.linalg.lstsq(x, y, rcond=None)
    return {
        "base_s": max(0.0, float(base)),
        "block_s": max(0.0, float(per_block)),
        "samples": [{"blocks": n, "seconds": t} for n, t in rows],
    }


def wait_for_quiet(threshold: float, max_wait_s: float) -> float:
    """Wait (up to ``max_wait_s``) until the 1-minute load average drops below ``threshold``."""
    deadline = time.monotonic() + max_wait_s
    load = os.getloadavg()[0]
    while load >= threshold and time.monotonic() < deadline:
        print(f"load average {load:.2f} >= {threshold}; waiting", file=sys.stderr)
        time.sleep(15)
        load = os.getloadavg()[0]
    return load


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.calibrate",
        description="Time engine steps and fit the simulator's cost profile.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (a served replica with num_cpus=1 gets 1)")  # fmt: skip
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--wait-load", type=float, default=None,
                   help="wait until the 1-min load average is below this first")  # fmt: skip
    p.add_argument("--max-wait", type=float, default=900.0, help="seconds, for --wait-load")
    p.add_argument("--name", default=None, help="profile name; default: the output file's stem")
    p.add_argument("--out", type=Path, default=DEFAULT_PROFILE)
    p.add_argument("--refit", type=Path, nargs="+", default=None,
                   help="refit the samples stored in these profiles (best of all of them) "
                   "instead of measuring")  # fmt: skip
    return p


def refit(paths: Sequence[Path], out: Path) -> Profile:
    """Fit again from the samples that one or more profiles recorded, taking the best of every
    point over all of them (no engine needed). The first profile provides everything else."""
    profiles = [Profile.load(path) for path in paths]
    old = profiles[0]
    samples = [StepSample(**s) for p in profiles for s in p.meta["samples"]]
    cost, quality = fit_samples(samples)
    meta = {
        **old.meta,
        **quality,
        "fit_on": "best of repeats per point",
        "samples": [s.__dict__ for s in samples],
        "transfer_samples": [t for p in profiles for t in p.meta.get("transfer_samples", [])],
        "runs": [
            {k: p.meta.get(k) for k in ("date", "loadavg_before", "loadavg_after")}
            for p in profiles
        ],
        "command": "python -m benchmarks.calibrate --refit "
        + " ".join(str(p) for p in paths)
        + f" --out {out}",
    }
    fastest = min(profiles, key=lambda p: p.transfer_block_s)
    profile = Profile.from_json(
        {
            **old.to_json(),
            "step": cost.__dict__,
            "transfer_base_s": fastest.transfer_base_s,
            "transfer_block_s": fastest.transfer_block_s,
            "meta": meta,
        }
    )
    profile.save(out)
    return profile


def main(argv: Sequence[str] | None = None) -> Profile:
    args = build_parser().parse_args(argv)
    if args.refit is not None:
        profile = refit(args.refit, args.out)
        print(json.dumps({"step": profile.step.__dict__, "fit": profile.meta["fit"]}))
        return profile
    from engine import LLM

    if args.wait_load is not None:
        wait_for_quiet(args.wait_load, args.max_wait)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        num_threads=args.threads,
        kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
    )
    e = _Engine(llm.engine)
    # Warm-up: first steps pay for lazy initialisation.
    for n in (64, 512, 2048):
        e.add(e.tokens(n), max_tokens=4)
    e.drain()
    load_before = os.getloadavg()
    started = time.perf_counter()
    prefill = measure_prefill(e, args.repeats)
    print(f"prefill: {len(prefill)} steps", file=sys.stderr)
    decode = measure_decode(e, args.repeats)
    print(f"decode: {len(decode)} steps", file=sys.stderr)
    mixed = measure_mixed(e, args.repeats)
    transfer = measure_transfer(e, args.repeats)
    load_after = os.getloadavg()
    cost, quality = fit_samples(prefill + decode + mixed)
    engine = llm.engine
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": _cpu_name(),
            "cpus": os.cpu_count(),
            "torch_threads": args.threads,
        },
        "engine": engine.model_info(),
        "loadavg_before": list(load_before),
        "loadavg_after": list(load_after),
        "measure_seconds": time.perf_counter() - started,
        **quality,
        "fit_on": "best of repeats per point",
        "transfer_samples": transfer["samples"],
        "samples": [s.__dict__ for s in prefill + decode + mixed],
        "command": "python -m benchmarks.calibrate "
        + " ".join(sys.argv[1:] if argv is None else argv),
    }
    profile = Profile(
        name=args.name or args.out.stem,
        step=cost,
        block_size=engine.block_size,
        kv_capacity_tokens=engine.num_blocks * engine.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        watermark=engine.config.watermark,
        transfer_base_s=transfer["base_s"],
        transfer_block_s=transfer["block_s"],
        meta=meta,
    )
    profile.save(args.out)
    _print_summary(profile, prefill, decode)
    return profile


def _cpu_name() -> str:
    from engine.cpuinfo import cpu_model_name

    return cpu_model_name() or platform.processor()


def _print_summary(profile: Profile, prefill: list[StepSample], decode: list[StepSample]) -> None:
    step = profile.step
    print(f"profile {profile.name}: KV capacity {profile.kv_capacity_tokens} tokens")
    for name in FEATURES:
        print(f"  {name:<20} {getattr(step, name):.4g}")
    by_len: dict[int, list[float]] = {}
    for s in prefill:
        if s.kind == "prefill":
            by_len.setdefault(s.prefill_tokens, []).append(s.seconds)
    for n, ts in sorted(by_len.items()):
        print(f"  prefill {n:>5} tokens: median {statistics.median(ts) * 1e3:8.1f} ms")
    by_batch: dict[tuple[int, int], list[float]] = {}
    for s in decode:
        ctx = s.decode_ctx // max(1, s.decode_seqs) // 16 * 16
        by_batch.setdefault((s.decode_seqs, ctx), []).append(s.seconds)
    for (b, c), ts in sorted(by_batch.items()):
        print(f"  decode batch {b:>3} ctx ~{c:>5}: median {statistics.median(ts) * 1e3:8.1f} ms")
    print(f"  transfer: {profile.transfer_base_s * 1e3:.2f} ms + "
          f"{profile.transfer_block_s * 1e3:.3f} ms/block")  # fmt: skip
    print(f"  fit: {profile.meta['fit']}")
    print(f"  mixed-step check: {profile.meta['mixed_check']}")
    print(f"  load average before {profile.meta['loadavg_before']}, "
          f"after {profile.meta['loadavg_after']}")  # fmt: skip


if __name__ == "__main__":
    main()
