"""Two latency classes under overload: the tight class's time to first token under FCFS and
under the deadline policy, at the throughput each reaches.

    python -m benchmarks.slo_classes --repeat 2

Offline, in one process: an ``LLMEngine`` (no HTTP, no Ray), fed an open-loop arrival trace in
wall-clock time, so that the queue in front of the engine is the only one measured. The trace
is Poisson arrivals at ``--rate`` requests per second for ``--duration`` seconds, drawn once
from ``--seed`` and replayed identically under each policy:

* tight (``--tight-share`` of requests): a short prompt, few output tokens, ``deadline_ms``;
* loose: a longer prompt, more output tokens, no deadline.

The rate is meant to exceed what the engine serves (``--max-num-seqs`` caps the running batch),
so a queue builds up. The default is a burst (about 70 requests within 2 s), which overloads the
engine whatever its speed: with a steady rate near its capacity, a machine whose speed varies
(shared cores) is overloaded in one run and not in the next, or so slow that the tight class
alone outruns the running slots that free up. Every request is served to completion (nothing is rejected), and TTFT is
measured from each request's arrival in the trace, waiting included. Throughput is the output
tokens of all requests divided by the time from the first arrival to the last token. Each
policy has one engine, built, warmed up (``engine.warmup``) and settled by an untimed replay
of the trace's first requests before any run. With ``--repeat N`` the policies take turns N
times on their engines (so that a noisy neighbour hits both alike) and each figure is the
median over the N runs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.offline import parse_engine_opts
from engine import LLM, LLMEngine, SamplingParams
from engine.warmup import warm_up


@dataclass(frozen=True)
class Arrival:
    at_s: float
    cls: str
    prompt: list[int]
    max_tokens: int
    deadline_ms: float | None


@dataclass
class ClassResult:
    requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    missed_deadline: int


@dataclass
class PolicyResult:
    policy: str
    output_tokens: int
    seconds: float
    throughput_tok_s: float
    classes: dict[str, ClassResult]
    # Engine steps the run took, the mean wall time of one, and the CPU time of the engine's
    # thread per output token (what a step costs the machine, whatever else shares it: with one
    # torch thread all of a step's work runs on this thread).
    steps: int = 0
    step_ms: float = 0.0
    cpu_ms_per_token: float = 0.0


def make_trace(args: argparse.Namespace) -> list[Arrival]:
    rng = random.Random(args.seed)
    trace, t = [], 0.0
    while True:
        t += rng.expovariate(args.rate)
        if t >= args.duration:
            return trace
        tight = rng.random() < args.tight_share
        n_prompt = args.tight_prompt if tight else args.loose_prompt
        trace.append(
            Arrival(
                at_s=t,
                cls="tight" if tight else "loose",
                # Mapped onto the model's vocabulary when replayed (``token_ids``).
                prompt=[rng.randrange(1 << 30) for _ in range(n_prompt)],
                max_tokens=args.tight_output if tight else args.loose_output,
                deadline_ms=args.deadline_ms if tight else None,
            )
        )


def token_ids(raw: list[int], vocab: int) -> list[int]:
    """Raw draws as ordinary token ids of a ``vocab``-sized vocabulary (clear of the low ids
    tokenizers keep for special tokens)."""
    low = min(100, vocab // 2)
    return [low + t % (vocab - low) for t in raw]


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def build(policy: str, trace: list[Arrival], args: argparse.Namespace) -> LLMEngine:
    """An engine for ``policy``, warmed up, then settled by an untimed replay of the trace's
    first ``--settle`` requests (the first run in a process was measured slower than the
    later ones even after the warm-up)."""
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        scheduling_policy=policy,
        max_num_seqs=args.max_num_seqs,
        **parse_engine_opts(args.engine_opt),
    )
    warm_up(llm.engine)
    if args.settle:
        run(llm.engine, trace[: args.settle], args)
    return llm.engine


def run(engine: LLMEngine, trace: list[Arrival], args: argparse.Namespace) -> PolicyResult:
    """Replay ``trace`` on the idle ``engine``; leaves it idle, its cache and counters reset."""
    policy = engine.config.scheduling_policy
    vocab = engine.model_cfg.vocab_size
    start = time.monotonic()
    first_token: dict[str, float] = {}
    tokens = 0
    busy_s = cpu_s = 0.0
    i = 0
    while i < len(trace) or engine.has_unfinished_requests():
        now = time.monotonic()
        while i < len(trace) and start + trace[i].at_s <= now:
            a = trace[i]
            params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(
                str(i),
                token_ids(a.prompt, vocab),
                params,
                arrival_time=start + a.at_s,
                deadline_ms=a.deadline_ms,
            )
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, start + trace[i].at_s - time.monotonic()))
            continue
        cpu = time.thread_time()
        deltas = engine.step()
        cpu_s += time.thread_time() - cpu
        done_at = time.monotonic()
        busy_s += done_at - now
        for d in deltas:
            tokens += len(d.new_token_ids)
            first_token.setdefault(d.request_id, done_at)
    seconds = time.monotonic() - start - trace[0].at_s
    classes = {}
    for cls in ("tight", "loose"):
        ids = [k for k, a in enumerate(trace) if a.cls == cls]
        if not ids:
            continue
        ttft = [(first_token[str(k)] - start - trace[k].at_s) * 1000 for k in ids]
        missed = sum(
            1
            for k, t in zip(ids, ttft, strict=True)
            if trace[k].deadline_ms is not None and t > trace[k].deadline_ms
        )
        classes[cls] = ClassResult(len(ids), percentile(ttft, 50), percentile(ttft, 99), missed)
    steps = engine.stats.num_steps
    step_ms = busy_s * 1000 / max(1, steps)
    engine.kv.pool.reset_prefix_cache()
    engine.reset_counters()
    return PolicyResult(
        policy, tokens, seconds, tokens / seconds, classes, steps, step_ms, cpu_s * 1000 / tokens
    )


def median_result(runs: list[PolicyResult]) -> PolicyResult:
    """Each figure's median over runs of one policy on one trace."""

    def med(values: list[float]) -> float:
        return statistics.median(values)

    classes = {
        cls: ClassResult(
            runs[0].classes[cls].requests,
            med([r.classes[cls].ttft_p50_ms for r in runs]),
            med([r.classes[cls].ttft_p99_ms for r in runs]),
            round(med([r.classes[cls].missed_deadline for r in runs])),
        )
        for cls in runs[0].classes
    }
    return PolicyResult(
        runs[0].policy,
        runs[0].output_tokens,
        med([r.seconds for r in runs]),
        med([r.throughput_tok_s for r in runs]),
        classes,
        round(med([r.steps for r in runs])),
        med([r.step_ms for r in runs]),
        med([r.cpu_ms_per_token for r in runs]),
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rate", type=float, default=40.0, help="arrivals per second")
    ap.add_argument("--duration", type=float, default=2.0, help="seconds of arrivals")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--tight-share", type=float, default=0.25)
    ap.add_argument("--tight-prompt", type=int, default=64)
    ap.add_argument("--tight-output", type=int, default=16)
    ap.add_argument("--loose-prompt", type=int, default=256)
    ap.add_argument("--loose-output", type=int, default=64)
    ap.add_argument("--deadline-ms", type=float, default=1000.0)
    ap.add_argument("--policies", default="fcfs,deadline")
    ap.add_argument("--repeat", type=int, default=1, help="turns per policy (medians)")
    ap.add_argument("--settle", type=int, default=10, help="requests replayed untimed first")
    ap.add_argument("--engine-opt", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    trace = make_trace(args)
    if not trace:
        raise SystemExit("no arrivals: raise --rate or --duration")
    n_tight = sum(a.cls == "tight" for a in trace)
    print(
        f"{len(trace)} requests over {args.duration:g} s ({n_tight} tight: "
        f"{args.tight_prompt} in / {args.tight_output} out, deadline {args.deadline_ms:g} ms; "
        f"{len(trace) - n_tight} loose: {args.loose_prompt} in / {args.loose_output} out), "
        f"max_num_seqs {args.max_num_seqs}, {torch.get_num_threads()} threads"
    )
    policies = args.policies.split(",")
    engines = {p: build(p, trace, args) for p in policies}
    runs: dict[str, list[PolicyResult]] = {p: [] for p in policies}
    for _ in range(args.repeat):
        for p in policies:
            runs[p].append(run(engines[p], trace, args))
    results = [median_result(runs[p]) for p in policies]
    print(
        f"{'policy':<10} {'tok/s':>7} {'steps':>6} {'ms/step':>8} {'cpu ms/tok':>10} {'tight p50':>10} "
        f"{'tight p99':>10} {'missed':>7} {'loose p50':>10} {'loose p99':>10}"
    )
    for r in results:
        t, lo = r.classes.get("tight"), r.classes.get("loose")
        print(
            f"{r.policy:<10} {r.throughput_tok_s:>7.1f} {r.steps:>6} {r.step_ms:>8.1f} "
            f"{r.cpu_ms_per_token:>10.2f} "
            f"{t.ttft_p50_ms if t else 0:>8.0f}ms {t.ttft_p99_ms if t else 0:>8.0f}ms "
            f"{t.missed_deadline if t else 0:>7} "
            f"{lo.ttft_p50_ms if lo else 0:>8.0f}ms {lo.ttft_p99_ms if lo else 0:>8.0f}ms"
        )
    if len(results) == 2 and all("tight" in r.classes for r in results):
        base, new = results
        print(
            f"tight TTFT p99: {base.classes['tight'].ttft_p99_ms / new.classes['tight'].ttft_p99_ms:.1f}x "
            f"better under {new.policy} than {base.policy}; throughput "
            f"{new.throughput_tok_s / base.throughput_tok_s:.2f}x"
        )
    if args.json:
        print(json.dumps([asdict(r) for r in results]))


if __name__ == "__main__":
    main()
