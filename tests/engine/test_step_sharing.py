"""Same-step prefix sharing (``engine.step_sharing``) end to end on a tiny random model: a burst
of requests behind new prefixes is admitted in one step, the followers reading the blocks their
leaders compute in that step, and greedy tokens are those of an engine without prefix caching,
on every CPU attention path, through chunked prefill, ``n`` identical prompts and a planned step
that loses its leader."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from engine import LLMEngine, Request, SamplingParams
from engine.attention import cpu_backend
from engine.attention.cpu_backend import CpuAttentionPlan
from engine.kernels import native
from engine.kv_cache_manager import KVCacheManager
from engine.model.linear import decode_max_rows
from engine.step_sharing import StepBlocks
from tests.engine.helpers import make_engine
from tests.engine.helpers import random_tokens as tokens

BS = 16
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

needs_native = pytest.mark.skipif(not native.available(), reason="needs the native kernels")


@dataclass
class Burst:
    """``num_prefixes`` new prefixes behind ``per_prefix`` requests each, after an optional
    system prompt every request starts with (computed and cached beforehand)."""

    num_prefixes: int = 4
    per_prefix: int = 2
    prefix_len: int = 48
    suffix_len: int = 8
    system_len: int = 0

    def system(self) -> list[int]:
        return tokens(self.system_len, 1)

    def prompts(self) -> dict[str, list[int]]:
        out = {}
        for k in range(self.per_prefix):
            for p in range(self.num_prefixes):
                prefix = tokens(self.prefix_len, 10 + p)
                out[f"p{p}-{k}"] = (
                    self.system() + prefix + tokens(self.suffix_len, 100 + 10 * p + k)
                )
        return out


def drain(engine: LLMEngine, max_steps: int = 200) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for d in engine.step():
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
    raise AssertionError("engine did not drain")


def assert_all_blocks_free(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks
    assert engine.kv.req_blocks == {}


def run_burst(
    engine: LLMEngine, burst: Burst, after_first: Callable[[], None] | None = None
) -> tuple[dict[str, list[int]], list]:
    """Greedy tokens of each request of the burst, and the first burst step's deltas
    (``after_first`` runs after that step)."""
    if burst.system_len:
        engine.add_request("system", burst.system() + [5], SamplingParams(max_tokens=1))
        drain(engine)
    for rid, prompt in burst.prompts().items():
        engine.add_request(rid, prompt, PARAMS)
    first = engine.step()
    if after_first is not None:
        after_first()
    outputs = {d.request_id: list(d.new_token_ids) for d in first}
    for rid, ids in drain(engine).items():
        outputs.setdefault(rid, []).extend(ids)
    assert_all_blocks_free(engine)
    return outputs, first


def force_path(engine: LLMEngine, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the CPU backend take ``path`` for the burst's prefill chunks."""
    if path == "torch":
        assert engine.runner.backend.name == "torch"
        return
    backend = engine.runner.backend
    assert backend.name == "cpu"
    if path in ("native", "native-stack", "cascade"):
        backend.native_max_pairs = None  # every chunk in the native kernel
    elif path == "sdpa":
        backend.native_max_pairs = 0  # every chunk of more than one token in SDPA
    if path == "cascade":
        backend.split_chunks = True  # chunks join the split in bf16 too
        monkeypatch.setattr(cpu_backend, "CASCADE_MIN_PAIRS", 1)


def watch_plans(engine: LLMEngine) -> list:
    """The attention plan of every step the engine prepares from now on."""
    plans: list = []
    backend = engine.runner.backend
    prepare = backend.prepare

    def recording(meta):
        prepare(meta)
        plans.append(meta.plan)

    backend.prepare = recording
    return plans


def watch_native_stack(engine: LLMEngine) -> list[bool]:
    """Per model forward from now on: whether the one-call native stack ran it."""
    calls: list[bool] = []
    stack = engine.model.native_forward
    assert stack is not None
    run = stack.run

    def counting(*args, **kwargs):
        out = run(*args, **kwargs)
        calls.append(out is not None)
        return out

    stack.run = counting
    return calls


PATHS: dict[str, tuple[str, Burst]] = {
    "torch": ("torch", Burst()),
    "native": ("cpu", Burst()),
    "sdpa": ("cpu", Burst()),
    # Every sequence of the burst step starts with the cached system prompt's blocks.
    "cascade": ("cpu", Burst(system_len=32, prefix_len=32)),
    # Within the decode kernels' rows: 2 x 36 + 2 x 4 tokens.
    "native-stack": ("cpu", Burst(num_prefixes=2, prefix_len=32, suffix_len=4)),
}


def check_path(path: str, plans: list, stack_calls: list[bool], burst_step: int) -> None:
    """The burst's step (index ``burst_step`` of the steps watched) took ``path``."""
    if path == "torch":
        return
    if path == "native-stack":
        assert stack_calls[burst_step]
        return
    plan = plans[burst_step]
    assert isinstance(plan, CpuAttentionPlan)
    if path == "native":
        assert plan.sdpa_seqs == [] and plan.shared_prefix_tokens == 0
    elif path == "sdpa":
        assert plan.native_seqs is None and len(plan.sdpa_seqs) > 0
    elif path == "cascade":
        assert plan.shared_prefix_tokens == 32 and plan.sdpa_seqs == []


# The native stack runs bf16 steps only.
CASES = [
    (p, d) for p in PATHS for d in ("float32", "bfloat16") if (p, d) != ("native-stack", "float32")
]


@needs_native
@pytest.mark.parametrize("path, dtype", CASES)
def test_a_burst_shares_its_new_prefixes_in_one_step_with_the_tokens_of_no_caching(
    tiny_llama, dtype, path, monkeypatch
):
    """Every path reads the leaders' blocks of the step after they are written: the followers'
    tokens are those they get computing the prefix themselves. The shared-prefix split is forced
    for the burst's step only (later steps stay unsplit in both engines; the one without
    caching has no cached prefix to split). In bf16 the split rounds differently from unsplit
    attention by itself, which flips later tokens of this random model, leaders' included:
    there the burst step's tokens, the ones sharing decides, are compared."""
    backend, burst = PATHS[path]
    if path == "native-stack":
        if native.decode_linear_kind() is None:
            pytest.skip("the native stack needs a CPU with AMX or AVX512-BF16")
        assert 2 * (burst.prefix_len + 2 * burst.suffix_len) <= decode_max_rows()
    unsplit = cpu_backend.CASCADE_MIN_PAIRS
    outputs = {}
    for caching in (True, False):
        engine = make_engine(
            tiny_llama,
            dtype=dtype,
            attention_backend=backend,
            block_size=BS,
            enable_prefix_caching=caching,
            max_num_batched_tokens=2048,
        )
        force_path(engine, path, monkeypatch)
        plans = watch_plans(engine)
        stack_calls = watch_native_stack(engine) if path == "native-stack" else []
        outputs[caching], first = run_burst(
            engine, burst, lambda: monkeypatch.setattr(cpu_backend, "CASCADE_MIN_PAIRS", unsplit)
        )
        num_requests = burst.num_prefixes * burst.per_prefix
        # One step computes every prompt of the burst: each samples its first token in it.
        assert len(first) == num_requests
        if caching:
            followers = num_requests - burst.num_prefixes
            system_hits = num_requests * burst.system_len
            assert [d.num_cached_tokens for d in first] == [burst.system_len] * (
                burst.num_prefixes
            ) + [burst.system_len + burst.prefix_len] * followers
            assert engine.stats.cache_hit_tokens_local == system_hits + followers * burst.prefix_len
            check_path(path, plans, stack_calls, 1 if burst.system_len else 0)
    if (path, dtype) == ("cascade", "bfloat16"):
        outputs = {c: {r: ids[:1] for r, ids in out.items()} for c, out in outputs.items()}
    assert outputs[True] == outputs[False]


@needs_native
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_leaders_prefix_chunked_over_two_steps(tiny_llama, dtype):
    """The leader's 4-block prefix takes two steps (48 tokens a step): the follower waits while
    the first chunk stops short of the prefix, then in the second hits its first three blocks
    and reads the fourth from the leader's chunk of that step."""
    prefix = tokens(64, 40)
    prompts = {"leader": prefix + tokens(8, 41), "follower": prefix + tokens(8, 42)}
    outputs = {}
    for caching in (True, False):
        engine = make_engine(
            tiny_llama,
            dtype=dtype,
            block_size=BS,
            enable_prefix_caching=caching,
            max_num_batched_tokens=48,
        )
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, PARAMS)
        outputs[caching] = {}
        steps = []
        while engine.has_unfinished_requests():
            deltas = engine.step()
            steps.append({d.request_id: d for d in deltas})
            for d in deltas:
                outputs[caching].setdefault(d.request_id, []).extend(d.new_token_ids)
        if caching:
            assert steps[0] == {}
            assert set(steps[1]) == {"leader", "follower"}
            assert steps[1]["follower"].num_cached_tokens == 64
            assert engine.stats.cache_hit_tokens_local == 64
        assert_all_blocks_free(engine)
    assert outputs[True] == outputs[False]


def test_n_identical_prompts_start_together(tiny_llama):
    """``n`` choices of one prompt (one group): all start in the first step, the others reading
    every block but the last from the first, with the same greedy tokens."""
    prompt = tokens(40, 50)
    outputs = {}
    for caching in (True, False):
        engine = make_engine(tiny_llama, block_size=BS, enable_prefix_caching=caching)
        for k in range(3):
            engine.add_request(f"n{k}", prompt, PARAMS, group_id="g")
        first = engine.step()
        assert len(first) == 3
        if caching:
            assert [d.num_cached_tokens for d in first] == [0, 32, 32]
        outputs[caching] = drain(engine)
        assert_all_blocks_free(engine)
    assert outputs[True] == outputs[False]
    assert len({tuple(o) for o in outputs[True].values()}) == 1


def planned_burst(model_dir, aborted: str | None) -> tuple[LLMEngine, dict[str, list[int]]]:
    """With ``async_scheduling``: a leader and a follower arrive while a step runs, so the next
    step is planned with the follower reading the leader's blocks; then ``aborted`` leaves
    before that step runs."""
    engine = make_engine(model_dir, block_size=BS, async_scheduling=True)
    outputs: dict[str, list[int]] = {}

    def step() -> None:
        for d in engine.step():
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)

    engine.add_request("busy", tokens(5, 60), SamplingParams(max_tokens=20, temperature=0.0))
    step()
    prefix = tokens(48, 61)
    engine.add_request("leader", prefix + tokens(8, 62), PARAMS)
    engine.add_request("follower", prefix + tokens(8, 63), PARAMS)
    step()  # plans the next step meanwhile
    planned = engine._pipeline._next
    assert planned is not None
    assert {f: [r.request_id for r in ls] for f, ls in planned.out.shared_from.items()} == {
        "follower": ["leader"]
    }
    if aborted is not None:
        assert engine.abort_request(aborted)
    while engine.has_unfinished_requests():
        step()
    assert_all_blocks_free(engine)
    return engine, outputs


@pytest.mark.parametrize("aborted", ["leader", "follower"])
def test_a_planned_step_that_loses_its_leader_withdraws_the_follower(tiny_llama, aborted):
    """The leader aborted between steps: the follower leaves the planned step with it and later
    computes the prefix itself (it never reads blocks nobody wrote); the follower aborted: the
    leader runs on alone. Either way the survivor's tokens are those of no abort and the blocks
    all come back."""
    _, expected = planned_burst(tiny_llama, None)
    engine, got = planned_burst(tiny_llama, aborted)
    survivor = "follower" if aborted == "leader" else "leader"
    assert got[survivor] == expected[survivor] and aborted not in got
    assert engine.stats.finished["abort"] == 1
    if aborted == "leader":
        assert engine.stats.cache_hit_tokens_local == 0


def test_a_block_its_token_in_flight_completes_is_not_recorded():
    """In a step planned ahead, a decode whose input token is still being sampled completes a
    block that has no hash yet: nothing is recorded for it, and nobody can read it."""
    kv = KVCacheManager(16, 4)
    request = Request("r", tokens(6, 70), PARAMS, block_size=4)
    assert kv.allocate_slots(request, 6)
    request.num_computed_tokens = 6
    request.append_output_token(7)
    request.num_inflight_tokens = 1  # token 8 of 8: block 1 completes with it
    assert kv.allocate_slots(request, 2)
    step_blocks = StepBlocks(kv)
    step_blocks.add(request, 2)
    assert len(request.block_hashes) == 1
    follower = Request("f", [*request.all_token_ids, 9, 10, 11], PARAMS, block_size=4)
    assert step_blocks.extend(follower, 1).blocks == []
