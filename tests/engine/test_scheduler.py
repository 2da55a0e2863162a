"""Scheduler: token budget, sequence cap, chunked prefill, preemption, queue order (no model)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput, WaitingQueue

BS = 4
_tokens = itertools.count(1000)


class Sim:
    """A scheduler driven as the engine drives it, with a fake model that always samples 7."""

    def __init__(self, num_blocks: int = 64, **options: object) -> None:
        options.setdefault("watermark", 0.0)
        self.config = EngineConfig(model="unused", block_size=BS, **options)
        self.kv = KVCacheManager(
            num_blocks, BS, self.config.enable_prefix_caching, self.config.watermark
        )
        self.sched = Scheduler(self.config, self.kv, max_model_len=1024)
        self.clock = 0.0

    def add(self, rid: str, prompt_len: int, max_tokens: int = 100, priority: int = 0) -> Request:
        self.clock += 1.0
        request = Request(
            rid,
            [next(_tokens) for _ in range(prompt_len)],
            SamplingParams(max_tokens=max_tokens),
            priority=priority,
            arrival_time=self.clock,
            block_size=BS,
        )
        self.sched.add_request(request)
        return request

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        assert out.num_tokens <= self.config.max_num_batched_tokens
        assert len(self.sched.running) <= self.config.max_num_seqs
        return self.run(out)

    def run(self, out: SchedulerOutput) -> SchedulerOutput:
        """The model's part of a scheduled step."""
        for request in self.sched.update_from_output(out):
            request.append_output_token(7)
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                self.sched.finish_request(request, RequestStatus.FINISHED_LENGTH)
        self.kv.pool.check_invariants()
        return out


def plan(out: SchedulerOutput) -> dict[str, int]:
    return {r.request_id: n for r, n in out.scheduled}


def test_token_budget_splits_prefills():
    sim = Sim(max_num_batched_tokens=10)
    for rid in "abc":
        sim.add(rid, 6)
    assert plan(sim.step()) == {"a": 6, "b": 4}
    # b's prefill continues; a decodes; c gets the rest.
    assert plan(sim.step()) == {"a": 1, "b": 2, "c": 6}
    assert plan(sim.step()) == {"a": 1, "b": 1, "c": 1}


def test_max_num_seqs_caps_running_requests():
    sim = Sim(max_num_seqs=2)
    for rid in "abc":
        sim.add(rid, 3, max_tokens=2)
    assert plan(sim.step()) == {"a": 3, "b": 3}
    assert sim.sched.num_waiting == 1
    assert plan(sim.step()) == {"a": 1, "b": 1}  # both finish (2 tokens each)
    assert plan(sim.step()) == {"c": 3}


def test_chunked_prefill_shares_a_step_with_decodes():
    sim = Sim(max_num_batched_tokens=8)
    sim.add("short", 3)
    sim.step()
    long = sim.add("long", 30)
    out = sim.step()
    assert plan(out) == {"short": 1, "long": 7}
    assert plan(sim.step()) == {"short": 1, "long": 7}
    assert long.num_computed_tokens == 14
    assert long.num_output_tokens == 0
    for _ in range(3):
        sim.step()
    assert long.num_computed_tokens == 30
    assert long.num_output_tokens == 1  # sampled once its last chunk ran


def test_pending_prefill_tokens_count_prompts_not_yet_computed():
    sim = Sim(max_num_batched_tokens=8)
    sim.add("short", 3)
    assert sim.sched.num_pending_prefill_tokens == 3
    sim.step()
    assert sim.sched.num_pending_prefill_tokens == 0  # decoding owes no prefill
    sim.add("long", 30)
    sim.add("queued", 5)
    assert sim.sched.num_pending_prefill_tokens == 35
    sim.step()  # short decodes 1, long prefills 7
    assert sim.sched.num_pending_prefill_tokens == 28
    sim.sched.abort_request("queued")
    assert sim.sched.num_pending_prefill_tokens == 23


def test_prefix_hit_is_skipped_by_the_prefill():
    sim = Sim()
    first = sim.add("a", 10, max_tokens=1)
    sim.step()
    assert first.is_finished
    second = Request(
        "b", first.prompt_token_ids + [1, 2], SamplingParams(), block_size=BS, arrival_time=99.0
    )
    sim.sched.add_request(second)
    out = sim.step()
    assert plan(out) == {"b": 4}
    assert second.num_cached_tokens == 8
    assert out.first_scheduled == [second]


def _with_prompt(
    sim: Sim,
    rid: str,
    tokens: list[int],
    group: str | None = None,
    root: bytes | None = None,
    params: SamplingParams | None = None,
) -> Request:
    sim.clock += 1.0
    request = Request(
        rid,
        tokens,
        params or SamplingParams(max_tokens=1),
        block_size=BS,
        arrival_time=sim.clock,
        group_id=group,
        hash_root=root,
    )
    sim.sched.add_request(request)
    return request


def test_requests_behind_an_uncomputed_shared_prefix_read_it_in_the_same_step():
    """Three requests share a 3-block prompt prefix that nobody has computed: the first computes
    it, and the other two, admitted in the same step, read its blocks instead of computing them
    (counted as cached); an unrelated request behind them is not held."""
    sim = Sim(max_num_batched_tokens=64)
    shared = [next(_tokens) for _ in range(12)]
    first = _with_prompt(sim, "first", shared + [1, 2])
    twins = [_with_prompt(sim, f"twin{i}", shared + [3 + i, 4]) for i in range(2)]
    other = _with_prompt(sim, "other", [next(_tokens) for _ in range(6)])
    out = sim.step()
    assert plan(out) == {"first": 14, "twin0": 2, "twin1": 2, "other": 6}
    assert [t.num_cached_tokens for t in twins] == [12, 12]
    assert all(r.is_finished for r in (first, *twins, other))
    assert {f: [r.request_id for r in ls] for f, ls in out.shared_from.items()} == {
        "twin0": ["first"],
        "twin1": ["first"],
    }
    assert sim.kv.pool.num_free_blocks == sim.kv.num_blocks


def test_a_burst_over_new_prefixes_is_scheduled_in_one_step():
    """Four new 3-block prefixes, each behind two requests: one step admits all eight, each
    follower holding the very blocks its leader computes in that step; after it the leaders'
    blocks are registered once each, and the blocks all come back at the end."""
    sim = Sim(max_num_batched_tokens=2048)
    prefixes = [[next(_tokens) for _ in range(12)] for _ in range(4)]
    reqs = [
        _with_prompt(sim, f"p{p}-{k}", prefixes[p] + [next(_tokens) for _ in range(5)])
        for k in range(2)
        for p in range(4)
    ]
    leaders, followers = reqs[:4], reqs[4:]
    out = sim.sched.schedule()
    assert plan(out) == {
        **{r.request_id: 17 for r in leaders},
        **{r.request_id: 5 for r in followers},
    }
    for leader, follower in zip(leaders, followers, strict=True):
        assert follower.num_computed_tokens == follower.num_cached_tokens == 12
        assert leader.num_cached_tokens == 0
        blocks = sim.kv.req_blocks[leader.request_id][:3]
        assert sim.kv.req_blocks[follower.request_id][:3] == blocks
        assert all(b.ref_cnt == 2 and b.block_hash is None for b in blocks)
        assert out.shared_from[follower.request_id] == [leader]
    sim.sched.update_from_output(out)
    for leader in leaders:
        for block, block_hash in zip(
            sim.kv.req_blocks[leader.request_id][:4], leader.block_hashes[:4], strict=True
        ):
            assert sim.kv.pool.cached[block_hash] is block
    sim.kv.pool.check_invariants()
    # Each follower's fourth block, its own suffix's, is its own.
    for follower in followers:
        assert (
            sim.kv.pool.cached[follower.block_hashes[3]]
            is sim.kv.req_blocks[follower.request_id][3]
        )
    for request in reqs:
        sim.sched.finish_request(request, RequestStatus.FINISHED_ABORTED)
    assert sim.kv.pool.num_free_blocks == sim.kv.num_blocks


def test_a_follower_reads_what_a_chunked_leader_completes_in_the_step():
    """The prefix owner is prefilled in chunks: the follower is held while the owner's chunk
    stops short of the prefix, and in the step whose chunk completes it, hits the blocks of
    earlier steps and reads the rest from the owner in that same step."""
    sim = Sim(max_num_batched_tokens=10)
    shared = [next(_tokens) for _ in range(16)]
    owner = _with_prompt(sim, "owner", shared + [1])
    follower = _with_prompt(sim, "follower", shared + [2])
    assert plan(sim.step()) == {"owner": 10}
    assert follower.status == RequestStatus.WAITING
    assert sim.kv.pool.num_free_blocks == sim.kv.num_blocks - 3
    out = sim.sched.schedule()
    assert plan(out) == {"owner": 7, "follower": 1}
    assert follower.num_cached_tokens == 16
    # Blocks 0 and 1 are prefix hits, 2 and 3 the owner's of this very step.
    assert sim.kv.block_ids("follower")[:4] == sim.kv.block_ids("owner")[:4]
    assert out.shared_from == {"follower": [owner]}


def test_a_follower_waits_for_a_block_its_leader_computes_in_a_later_step():
    """The leader sits this step out (its group's share, ``max_seqs_per_group``): its next
    block is in flight but not completed in the step, so the follower waits rather than
    compute it a second time, and a request behind it goes first; when the leader's turn comes,
    the follower reads the blocks of that step."""
    sim = Sim(max_num_batched_tokens=12, max_seqs_per_group=1)
    shared = [next(_tokens) for _ in range(16)]
    many = SamplingParams(max_tokens=20)
    _with_prompt(sim, "mate", [next(_tokens) for _ in range(3)], group="g", params=many)
    leader = _with_prompt(sim, "leader", shared + [1], group="g")
    assert plan(sim.step()) == {"mate": 3, "leader": 9}  # a group alone is not capped
    follower = _with_prompt(sim, "follower", shared + [2])
    _with_prompt(sim, "other", [next(_tokens) for _ in range(3)])
    out = sim.step()
    assert plan(out) == {"mate": 1, "other": 3}
    assert follower.status == RequestStatus.WAITING and not out.shared_from
    # Its turn: the leader completes the prefix, and the follower reads the part of this step.
    out = sim.step()
    assert plan(out) == {"leader": 8, "follower": 1}
    assert follower.num_cached_tokens == 16 and out.shared_from == {"follower": [leader]}


def test_a_follower_whose_prompt_is_all_shared_blocks_does_not_wait():
    """Identical prompts (``n`` choices): a hit never covers the last block, which holds the
    token to sample from, so the followers compute it themselves in the same step rather than
    wait for the leader's copy."""
    sim = Sim(max_num_batched_tokens=64)
    prompt = [next(_tokens) for _ in range(12)]
    reqs = [_with_prompt(sim, f"n{k}", list(prompt)) for k in range(3)]
    assert plan(sim.step()) == {"n0": 12, "n1": 4, "n2": 4}
    assert [r.num_cached_tokens for r in reqs] == [0, 8, 8]


def test_requests_with_other_cache_salts_share_nothing_in_a_step():
    """Another hash root (``cache_salt``) names other blocks: neither shared nor waited for."""
    sim = Sim(max_num_batched_tokens=64)
    shared = [next(_tokens) for _ in range(12)]
    a = _with_prompt(sim, "a", shared + [1], root=b"salt-a")
    b = _with_prompt(sim, "b", shared + [2], root=b"salt-b")
    same = _with_prompt(sim, "a2", shared + [3], root=b"salt-a")
    out = sim.step()
    assert plan(out) == {"a": 13, "b": 13, "a2": 1}
    assert (a.num_cached_tokens, b.num_cached_tokens, same.num_cached_tokens) == (0, 0, 12)


def test_a_request_that_skips_the_prefix_cache_neither_reads_nor_waits():
    """Prompt logprobs need every prompt position computed: such a request computes the shared
    prefix itself, in the same step; its blocks may still serve others."""
    sim = Sim(max_num_batched_tokens=64)
    shared = [next(_tokens) for _ in range(12)]
    _with_prompt(sim, "a", shared + [1])
    logprobs = _with_prompt(
        sim, "logprobs", shared + [2], params=SamplingParams(max_tokens=1, prompt_logprobs=1)
    )
    assert logprobs.skips_prefix_cache
    out = sim.sched.schedule()
    assert plan(out) == {"a": 13, "logprobs": 13} and not out.shared_from
    assert logprobs.num_cached_tokens == 0


def test_a_dropped_leader_takes_its_followers_admission_with_it():
    """A step planned ahead loses a request before it runs (an abort): whoever was to read its
    blocks in that step, directly or through another follower, goes back to waiting as if never
    admitted, and its blocks come back."""
    for aborted in ("leader", "middle"):
        sim = Sim(max_num_batched_tokens=64)
        a = [next(_tokens) for _ in range(8)]
        b = [next(_tokens) for _ in range(8)]
        _with_prompt(sim, "leader", a + [1])
        middle = _with_prompt(sim, "middle", a + b + [2])  # reads a, computes b
        last = _with_prompt(sim, "last", a + b + [3])  # reads a and b
        _with_prompt(sim, "other", [next(_tokens) for _ in range(5)])
        out = sim.sched.schedule()
        assert plan(out) == {"leader": 9, "middle": 9, "last": 1, "other": 5}
        assert [r.request_id for r in out.shared_from["last"]] == ["leader", "middle"]
        sim.sched.abort_request(aborted)
        assert sim.sched.drop_finished(out)
        withdrawn = [middle, last] if aborted == "leader" else [last]
        kept = {"leader": 9, "other": 5} if aborted == "middle" else {"other": 5}
        assert plan(out) == kept
        assert [r.request_id for r in out.first_scheduled] == list(kept)
        for request in withdrawn:
            assert request.status == RequestStatus.WAITING
            assert (request.num_computed_tokens, request.num_cached_tokens) == (0, -1)
            assert request.request_id not in sim.kv.req_blocks
        assert list(sim.sched.waiting) == withdrawn
        assert not sim.sched.drop_finished(out)
        sim.run(out)
        # Nothing is lost: the withdrawn requests run later and every block comes back.
        while sim.sched.has_unfinished():
            sim.step()
        assert sim.kv.pool.num_free_blocks == sim.kv.num_blocks


def test_a_withdrawn_readmission_waits_again_as_preempted():
    """A preempted request readmitted in a plan that then loses its leader is preempted again,
    not new: its first scheduling and its hit stay counted once."""
    sim = Sim(max_num_batched_tokens=3, scheduling_policy="shortest_prompt")
    a = [next(_tokens) for _ in range(8)]
    follower = _with_prompt(sim, "follower", a + [2, 3], params=SamplingParams(max_tokens=4))
    assert plan(sim.step()) == {"follower": 3}  # no full block computed yet
    sim.sched._preempt(follower)
    sim.sched.config = sim.config = dataclasses.replace(sim.config, max_num_batched_tokens=64)
    _with_prompt(sim, "leader", a + [1])  # shorter: admitted first
    out = sim.sched.schedule()
    assert plan(out) == {"leader": 9, "follower": 2}
    assert out.first_scheduled == [out.scheduled[0][0]]
    sim.sched.abort_request("leader")
    assert sim.sched.drop_finished(out) and out.is_empty
    assert follower.status == RequestStatus.PREEMPTED
    assert (follower.num_computed_tokens, follower.num_cached_tokens) == (0, 0)
    assert sim.kv.pool.num_free_blocks == sim.kv.num_blocks
    assert plan(sim.step()) == {"follower": 10}


def test_without_prefix_caching_nothing_waits():
    sim = Sim(max_num_batched_tokens=64, enable_prefix_caching=False)
    shared = [next(_tokens) for _ in range(12)]
    _with_prompt(sim, "a", shared + [1])
    _with_prompt(sim, "b", shared + [2])
    assert plan(sim.step()) == {"a": 13, "b": 13}


def fill_pool_with_decodes(sim: Sim, rids: str, priorities: list[int] | None = None) -> None:
    """Admit one 4-token request per id, each filling one block, then run their prefill: every
    request then needs a second block for its first decode."""
    for i, rid in enumerate(rids):
        sim.add(rid, 4, priority=priorities[i] if priorities else 0)
    out = sim.step()
    assert sorted(plan(out)) == sorted(rids)


def test_fcfs_preempts_the_latest_arrival():
    sim = Sim(num_blocks=4)
    fill_pool_with_decodes(sim, "abc")
    out = sim.step()
    # a takes the last free block; b needs one: c (latest) is preempted and b goes on.
    assert [r.request_id for r in out.preempted] == ["c"]
    assert plan(out) == {"a": 1, "b": 1}
    c = sim.sched.requests["c"]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert sim.kv.block_ids("c") == []
    assert sim.sched.num_preemptions_total == 1


def test_request_preempting_itself_when_it_is_the_latest():
    sim = Sim(num_blocks=3)
    fill_pool_with_decodes(sim, "abc")
    out = sim.step()
    # No block free: a preempts c and takes its block; b then preempts itself.
    assert [r.request_id for r in out.preempted] == ["c", "b"]
    assert plan(out) == {"a": 1}


def test_priority_preempts_the_lowest_priority_not_the_latest():
    sim = Sim(num_blocks=4, scheduling_policy="priority")
    fill_pool_with_decodes(sim, "abc", priorities=[0, 5, 1])
    out = sim.step()
    assert [r.request_id for r in out.preempted] == ["b"]
    assert plan(out) == {"a": 1, "c": 1}


def test_priority_victim_never_outranks_a_later_admitted_low_priority_request():
    """A high-priority request admitted after a low-priority one must not be the one preempted."""
    sim = Sim(num_blocks=3, scheduling_policy="priority")
    sim.add("low", 4, priority=9)
    sim.step()
    sim.add("high", 4, priority=0)
    out = sim.step()
    assert plan(out) == {"low": 1, "high": 4}
    # Both now need a new block and one is free: low must yield it to high.
    out = sim.step()
    assert [r.request_id for r in out.preempted] == ["low"]
    assert plan(out) == {"high": 1}


def test_no_admission_in_a_step_that_preempted():
    sim = Sim(num_blocks=4)
    fill_pool_with_decodes(sim, "abc")
    sim.add("tiny", 1)
    out = sim.step()
    assert out.preempted
    assert "tiny" not in plan(out)
    assert sim.sched.requests["tiny"].status == RequestStatus.WAITING


def test_fcfs_order_is_restored_after_preemption():
    sim = Sim(num_blocks=4)
    fill_pool_with_decodes(sim, "abc")
    sim.add("d", 2)
    sim.step()  # c preempted
    assert [r.request_id for r in sim.sched.waiting] == ["c", "d"]
    # Once a and b finish, c is admitted before d.
    for rid in "ab":
        sim.sched.finish_request(sim.sched.requests[rid], RequestStatus.FINISHED_STOPPED)
    out = sim.step()
    assert [r.request_id for r, _ in out.scheduled] == ["c", "d"]
    # c recomputes its prompt and the token it had generated (b's new block evicted c's cached
    # block when c was preempted, so nothing hits).
    assert plan(out) == {"c": 5, "d": 2}


def test_priority_order_then_arrival():
    sim = Sim(max_num_seqs=1, scheduling_policy="priority")
    sim.add("late-low", 2, max_tokens=1, priority=3)
    sim.add("hi-1", 2, max_tokens=1, priority=1)
    sim.add("hi-2", 2, max_tokens=1, priority=1)
    sim.add("top", 2, max_tokens=1, priority=0)
    order = [next(iter(plan(sim.step()))) for _ in range(4)]
    assert order == ["top", "hi-1", "hi-2", "late-low"]


def test_fcfs_ignores_priority():
    sim = Sim(max_num_seqs=1)
    sim.add("first", 2, max_tokens=1, priority=5)
    sim.add("second", 2, max_tokens=1, priority=0)
    assert [next(iter(plan(sim.step()))) for _ in range(2)] == ["first", "second"]


def test_admission_stops_at_the_first_request_that_does_not_fit():
    sim = Sim(num_blocks=4)
    sim.add("a", 8)
    sim.add("big", 12)
    sim.add("small", 2)
    out = sim.step()
    # big does not fit the 2 remaining blocks; small must not overtake it.
    assert plan(out) == {"a": 8}
    assert [r.request_id for r in sim.sched.waiting] == ["big", "small"]


def test_admission_keeps_the_watermark_free():
    sim = Sim(num_blocks=10, watermark=0.2)
    sim.add("a", 28)  # 7 blocks, leaving 3 free
    sim.add("b", 8)  # 2 blocks would leave 1 free, under the watermark of 2
    assert plan(sim.step()) == {"a": 28}
    assert sim.kv.pool.num_free_blocks == 3


def test_a_request_that_only_fits_an_empty_pool_is_still_admitted():
    """The watermark protects running requests; with none running it must not block forever."""
    sim = Sim(num_blocks=10, watermark=0.2)
    sim.add("whole-pool", 39, max_tokens=1)
    assert plan(sim.step()) == {"whole-pool": 39}


def test_abort_waiting_and_running_requests_frees_their_blocks():
    sim = Sim(max_num_batched_tokens=8)
    sim.add("run", 6)
    sim.add("wait", 6)
    sim.step()
    assert sim.sched.abort_request("run").status == RequestStatus.FINISHED_ABORTED
    assert sim.sched.abort_request("wait").status == RequestStatus.FINISHED_ABORTED
    assert sim.sched.abort_request("wait") is None
    assert sim.sched.abort_request("never") is None
    assert not sim.sched.has_unfinished()
    assert sim.kv.pool.num_free_blocks == sim.kv.num_blocks
    assert sim.step().is_empty


def test_duplicate_request_id_is_rejected():
    sim = Sim()
    sim.add("a", 2)
    with pytest.raises(ValueError, match="^request_id:"):
        sim.add("a", 2)


def test_waiting_queue_keeps_a_preempted_requests_place():
    queue = WaitingQueue("fcfs")
    reqs = [Request(str(i), [1], SamplingParams(), arrival_time=float(i)) for i in range(3)]
    for r in (reqs[0], reqs[2]):
        queue.push(r)
    queue.push(reqs[1])
    assert [r.request_id for r in queue] == ["0", "1", "2"]
    assert queue.pop() is reqs[0]
    queue.push(reqs[0])  # back after preemption: still first
    assert queue.peek() is reqs[0]
    assert queue.remove(reqs[1]) and not queue.remove(reqs[1])
    assert len(queue) == 2
