"""Where the time of one engine step goes: decode steps at a given batch size.

    python -m benchmarks.profile_step --dtype bfloat16 --batch 64 --context 160

Admits ``--batch`` requests of ``--context`` tokens, runs their prefills, then times ``--steps``
all-decode steps (wall clock per step: scheduling + model + sampling + bookkeeping), prints where
each step's time went (``--no-breakdown`` to skip) and torch.profiler's table of the costliest ops
over those steps.

The breakdown times each phase by wrapping the engine's own calls (schedule, prepare, forward,
logits, sample, outputs: appending tokens, stop checks, detokenization, deltas) and says which
thread spent it. "engine thread, other" is the step's wall time on the engine thread outside
those phases; with ``--engine-opt async_scheduling=true`` schedule and prepare move to the
planning thread, where they overlap the forward.

``--idle-team`` first runs a parallel op on another thread that then stays alive, as a serving
process's event loop would after building the engine there: its OpenMP team outnumbers the
CPUs, and libgomp then stops spinning at barriers (see ``engine.async_engine``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.offline import parse_engine_opts
from engine import LLM, LLMEngine, SamplingParams
from engine.kv_cache_manager import cdiv


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--no-fused", action="store_true", help="reference elementwise ops")
    ap.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--idle-team", action="store_true", help="leave a second OpenMP team alive")
    ap.add_argument("--no-breakdown", action="store_true", help="skip the per-phase timing")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.idle_team:
        _start_idle_team()
    extra = parse_engine_opts(args.engine_opt)
    llm = LLM(model=args.model, dtype=args.dtype, enable_prefix_caching=False, **extra)
    engine = llm.engine
    engine.model.use_fused = not args.no_fused
    # Every sequence stays running through every step below (the prefill's token, 3 warm-up
    # steps, then ``--steps`` timed, for the breakdown and for the profiler each): their blocks
    # must fit together, or the waiting ones never start and the prefill loop never ends.
    kv = engine.kv
    decode_steps = 4 + args.steps * (1 + (not args.no_breakdown) + (not args.no_profile))
    per_seq = cdiv(args.context + decode_steps, kv.block_size)
    if args.batch * per_seq > kv.num_blocks:
        ap.error(
            f"{args.batch} sequences of {args.context} tokens need {args.batch * per_seq} KV "
            f"blocks, the cache has {kv.num_blocks}: raise --engine-opt kv_cache_memory_gb=..."
        )
    rng = random.Random(0)
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [rng.randrange(100, 49152) for _ in range(args.context)], params)
    start = time.perf_counter()
    while any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.requests.values()
    ):
        engine.step()
    print(f"prefill of {args.batch}x{args.context} tokens: {time.perf_counter() - start:.2f} s")
    for _ in range(3):
        engine.step()

    times, cpu = [], []
    for _ in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        engine.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    med = statistics.median(times)
    # CPU time is less sensitive than wall time to other processes sharing the cores.
    print(
        f"decode step, batch {args.batch}: wall best {min(times) * 1e3:.1f} ms, median "
        f"{med * 1e3:.1f} ms -> {args.batch / med:.0f} tok/s; cpu best {min(cpu) * 1e3:.1f} ms, "
        f"median {statistics.median(cpu) * 1e3:.1f} ms (threads={torch.get_num_threads()})"
    )
    if not args.no_breakdown:
        print_breakdown(engine, args.steps)
    if args.no_profile:
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


PHASES = ("schedule", "prepare", "forward", "logits", "sample", "outputs")


def print_breakdown(engine: LLMEngine, steps: int) -> None:
    """Median ms per step of each phase over ``steps`` steps, by the thread that ran it."""
    engine_thread = threading.get_ident()
    spent: dict[str, float] = defaultdict(float)

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                where = "engine" if threading.get_ident() == engine_thread else "planner"
                spent[f"{where} thread, {name}"] += time.perf_counter() - t0

        return call

    targets = {
        "schedule": engine.scheduler,
        "prepare": engine.runner,
        "forward": engine.model,
        "logits": engine.model,
        "sample": engine.runner,
        "outputs": engine,
    }
    attrs = {"forward": "forward", "logits": "compute_logits", "sample": "sampler"}
    attrs |= {"outputs": "finish_step"}
    # Instance attributes (the sampler) to put back; methods are unshadowed by deleting.
    saved = {}
    for phase in PHASES:
        obj, attr = targets[phase], attrs.get(phase, phase)
        if attr in vars(obj):
            saved[phase] = vars(obj)[attr]
        setattr(obj, attr, timed(phase, getattr(obj, attr)))
    per_step: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        spent.clear()
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        on_engine = sum(v for k, v in spent.items() if k.startswith("engine"))
        spent["engine thread, other"] = wall - on_engine
        spent["step wall"] = wall
        for k, v in spent.items():
            per_step[k].append(v)
    for phase in PHASES:
        obj, attr = targets[phase], attrs.get(phase, phase)
        if phase in saved:
            setattr(obj, attr, saved[phase])
        else:
            delattr(obj, attr)
    print("step breakdown, median ms over", steps, "steps:")
    for k in sorted(per_step, key=lambda k: (k == "step wall", k)):
        print(f"  {k:<28} {statistics.median(per_step[k]) * 1e3:8.2f}")


def _start_idle_team() -> None:
    ready = threading.Event()

    def run() -> None:
        a = torch.randn(512, 512)
        a @ a  # a parallel op: this thread now masters a team of its own
        ready.set()
        threading.Event().wait()  # alive, idle, for the rest of the process

    threading.Thread(target=run, name="idle-team", daemon=True).start()
    ready.wait()


if __name__ == "__main__":
    main()
