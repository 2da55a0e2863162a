"""Deadlines, scoring policies, early rejection and the adaptive admission watermark (scheduler
alone, with a fake model that always samples 7; and through a tiny engine)."""

from __future__ import annotations

import itertools
import time

import pytest

from engine.admission_watermark import AdmissionWatermark
from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.scheduling_policy import POLICIES, SCORERS, policy_scorers
from tests.engine.helpers import make_engine
from tests.engine.helpers import random_tokens as tokens

BS = 4
_tokens = itertools.count(1000)


class Sim:
    """A scheduler on a manual clock (seconds), driven as the engine drives it."""

    def __init__(self, num_blocks: int = 64, **options: object) -> None:
        options.setdefault("watermark", 0.0)
        options.setdefault("enable_prefix_caching", False)
        self.config = EngineConfig(model="unused", block_size=BS, **options)
        self.kv = KVCacheManager(
            num_blocks, BS, self.config.enable_prefix_caching, self.config.watermark
        )
        self.now = 0.0
        self.sched = Scheduler(self.config, self.kv, max_model_len=1024, clock=lambda: self.now)

    def add(
        self,
        rid: str,
        prompt_len: int,
        max_tokens: int = 100,
        priority: int = 0,
        deadline_ms: float | None = None,
    ) -> Request:
        self.now += 1.0
        request = Request(
            rid,
            [next(_tokens) for _ in range(prompt_len)],
            SamplingParams(max_tokens=max_tokens),
            priority=priority,
            arrival_time=self.now,
            deadline_ms=deadline_ms,
            block_size=BS,
        )
        self.sched.add_request(request)
        return request

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        for request in self.sched.update_from_output(out):
            request.append_output_token(7)
            if request.first_token_time is None:
                request.first_token_time = self.now
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                self.sched.finish_request(request, RequestStatus.FINISHED_LENGTH)
        self.kv.pool.check_invariants()
        return out

    def drain(self, max_steps: int = 200) -> list[SchedulerOutput]:
        outs = []
        while self.sched.has_unfinished():
            assert len(outs) < max_steps, "the scheduler did not drain"
            outs.append(self.step())
        return outs

    @property
    def used(self) -> int:
        return self.kv.num_blocks - self.kv.pool.num_free_blocks


def admitted(out: SchedulerOutput) -> list[str]:
    return [r.request_id for r, _ in out.scheduled]


# -- policies --------------------------------------------------------------------------------
def test_every_named_policy_is_a_tuple_of_known_scorers():
    assert set(POLICIES) == {"fcfs", "priority", "deadline", "shortest_prompt"}
    for names in POLICIES.values():
        assert set(names) <= set(SCORERS)
    with pytest.raises(ValueError, match="scheduling_policy"):
        policy_scorers(("deadline", "luck"))
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(model="unused", scheduling_policy="edf")  # type: ignore[arg-type]


def test_deadline_policy_serves_the_earliest_deadline_first():
    sim = Sim(max_num_seqs=1, scheduling_policy="deadline")
    sim.add("none", 4, max_tokens=1)
    sim.add("late", 4, max_tokens=1, deadline_ms=90_000)
    sim.add("soon", 4, max_tokens=1, deadline_ms=5_000)
    # Arrival 3 s + 5 s beats arrival 2 s + 90 s; no deadline comes last.
    assert [admitted(sim.step()) for _ in range(3)] == [["soon"], ["late"], ["none"]]


def test_deadline_policy_keeps_priority_classes_first():
    sim = Sim(max_num_seqs=1, scheduling_policy="deadline")
    sim.add("urgent-class", 4, max_tokens=1, priority=-1)
    sim.add("tight-deadline", 4, max_tokens=1, deadline_ms=1)
    assert [admitted(sim.step()) for _ in range(2)] == [["urgent-class"], ["tight-deadline"]]


def test_fcfs_ignores_deadlines():
    sim = Sim(max_num_seqs=1, scheduling_policy="fcfs")
    sim.add("first", 4, max_tokens=1)
    sim.add("tight", 4, max_tokens=1, deadline_ms=1_000_000)
    assert [admitted(sim.step()) for _ in range(2)] == [["first"], ["tight"]]


def test_shortest_prompt_first():
    sim = Sim(max_num_seqs=1, scheduling_policy="shortest_prompt")
    sim.add("long", 20, max_tokens=1)
    sim.add("short", 3, max_tokens=1)
    sim.add("mid", 8, max_tokens=1)
    sim.add("short-later", 3, max_tokens=1)
    order = [admitted(sim.step()) for _ in range(4)]
    assert order == [["short"], ["short-later"], ["mid"], ["long"]]


def test_deadline_policy_preempts_the_lowest_priority_latest_deadline():
    sim = Sim(num_blocks=4, scheduling_policy="deadline")
    sim.add("p0-soon", 4, deadline_ms=1_000)
    sim.add("p1-soon", 4, priority=1, deadline_ms=1_000)
    sim.add("p0-late", 4, deadline_ms=60_000)
    sim.add("p1-late", 4, priority=1, deadline_ms=60_000)
    assert sorted(admitted(sim.step())) == ["p0-late", "p0-soon", "p1-late", "p1-soon"]
    # Every request needs a second block for its fifth token; the pool has none free.
    out = sim.step()
    assert [r.request_id for r in out.preempted] == ["p1-late", "p1-soon"]
    assert admitted(out) == ["p0-soon", "p0-late"]


# -- deadlines: counting and early rejection ------------------------------------------------
def test_late_waiting_request_is_rejected_before_it_takes_a_block():
    sim = Sim(max_num_seqs=1, reject_late_requests=True)
    sim.add("busy", 4, max_tokens=5)
    late = sim.add("tight", 4, max_tokens=5, deadline_ms=2_500)  # due at 4.5 s
    sim.add("loose", 4, max_tokens=5, deadline_ms=60_000)
    assert admitted(sim.step()) == ["busy"]
    sim.now = 4.4
    assert sim.step().rejected == []
    sim.now = 4.5
    out = sim.step()
    assert out.rejected == [late] and admitted(out) == ["busy"]
    assert late.status == RequestStatus.FINISHED_REJECTED and late.finish_reason == "rejected"
    assert late.missed_deadline and "tight" not in sim.sched.requests
    assert late.request_id not in sim.kv.req_blocks
    assert all(out.rejected == [] for out in sim.drain())
    assert sim.kv.pool.num_free_blocks == sim.kv.num_blocks


def test_a_request_past_its_first_token_is_never_rejected():
    sim = Sim(num_blocks=3, reject_late_requests=True)
    # Due at 2.5 s and 3.5 s; the first step runs at 2 s.
    first = sim.add("first", 4, max_tokens=4, deadline_ms=1_500)
    second = sim.add("second", 4, max_tokens=4, deadline_ms=1_500)
    sim.step()
    sim.step()  # both need a second block: "second" is preempted, its token already out
    assert first.num_output_tokens == 2 and second.status == RequestStatus.PREEMPTED
    sim.now = 100.0
    assert all(out.rejected == [] for out in sim.drain())
    assert first.status == second.status == RequestStatus.FINISHED_LENGTH


def test_without_rejection_late_requests_are_served():
    sim = Sim(max_num_seqs=1)
    sim.add("busy", 4, max_tokens=3)
    tight = sim.add("tight", 4, max_tokens=3, deadline_ms=1)
    sim.now = 50.0
    assert all(out.rejected == [] for out in sim.drain())
    assert tight.status == RequestStatus.FINISHED_LENGTH


def test_engine_rejects_and_counts_late_requests(tiny_llama):
    engine = make_engine(tiny_llama, reject_late_requests=True, max_num_seqs=1)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("ok", tokens(6, 0), params, deadline_ms=60_000)
    engine.add_request(
        "late", tokens(6, 1), params, arrival_time=time.monotonic() - 1.0, deadline_ms=5
    )
    deltas = engine.step()
    rejected = [d for d in deltas if d.request_id == "late"]
    assert len(rejected) == 1
    (d,) = rejected
    assert (d.finished, d.finish_reason, d.new_token_ids, d.num_output_tokens) == (
        True,
        "rejected",
        [],
        0,
    )
    assert engine.stats.deadline_missed == {"rejected": 1}
    assert engine.stats.finished["rejected"] == 1
    for _ in range(50):
        if not engine.has_unfinished_requests():
            break
        assert all(d.request_id == "ok" for d in engine.step())
    assert engine.kv.pool.num_free_blocks == engine.num_blocks


def test_engine_counts_requests_served_past_their_deadline(tiny_llama):
    engine = make_engine(tiny_llama)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.add_request(
        "late", tokens(6, 1), params, arrival_time=time.monotonic() - 1.0, deadline_ms=5
    )
    engine.add_request("fine", tokens(6, 2), params, deadline_ms=600_000)
    finals = {}
    for _ in range(50):
        finals.update({d.request_id: d.finish_reason for d in engine.step() if d.finished})
    assert finals == {"late": "length", "fine": "length"}
    assert engine.stats.deadline_missed == {"late": 1}


@pytest.mark.parametrize("bad", [0, -5, float("inf"), float("nan"), True, "10"])
def test_engine_refuses_a_bad_deadline(tiny_llama, bad):
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match="deadline_ms"):
        engine.add_request("r", tokens(4, 0), SamplingParams(max_tokens=1), deadline_ms=bad)


# -- the adaptive admission watermark ------------------------------------------------------
def _storm(adaptive: bool) -> tuple[Sim, list[tuple[int, list[str], list[str], int, int]]]:
    """Four 7-token prompts fill an 8-block pool; each needs a third block at its third step,
    so two are preempted at once. A small urgent request arrives at step 5 with 2 blocks free."""
    sim = Sim(
        num_blocks=8, scheduling_policy="priority", adaptive_watermark=adaptive, watermark=0.0
    )
    for rid in "abcd":
        sim.add(rid, 7, max_tokens=8)
    trace = []
    for step in range(1, 40):
        if step == 5:
            sim.add("e", 3, max_tokens=2, priority=-1)
        out = sim.step()
        trace.append(
            (
                step,
                admitted(out),
                [r.request_id for r in out.preempted],
                sim.used,
                sim.sched.watermark.level,
            )
        )
        if not sim.sched.has_unfinished():
            break
    return sim, trace


def test_watermark_drops_after_a_preemption_storm_and_recovers_as_requests_finish():
    sim, trace = _storm(adaptive=True)
    by_step = {t[0]: t[1:] for t in trace}
    assert by_step[2] == (["a", "b", "c", "d"], [], 8, 8)
    # a and b take the last free blocks; d, then c preempt themselves out of the batch.
    assert by_step[3] == (["a", "b"], ["d", "c"], 6, 6)
    # The level stays at 6 while a and b grow to 8 blocks: nothing finishes, nothing is admitted,
    # not even e (priority -1, one block) with 2 blocks free at steps 5 and 6.
    for step in range(4, 8):
        assert by_step[step][0] == ["a", "b"] and by_step[step][3] == 6
    assert by_step[7][2] == 8
    # a and b finish together at step 8: each gives back 4 blocks; the level is capped at 8.
    assert by_step[8] == (["a", "b"], [], 0, 8)
    assert by_step[9][0] == ["e", "c", "d"]
    assert sim.sched.num_preemptions_total == 2
    assert sim.kv.pool.num_free_blocks == 8 and sim.kv.req_blocks == {}


def test_fixed_watermark_admits_into_the_shortage():
    _, trace = _storm(adaptive=False)
    by_step = {t[0]: t[1:] for t in trace}
    assert by_step[3][1] == ["d", "c"] and by_step[3][3] == 8
    assert by_step[5][0] == ["a", "b", "e"]


def test_watermark_level_bounds():
    wm = AdmissionWatermark.for_pool(100, 0.05, adaptive=True)
    assert (wm.base, wm.level, wm.reserve) == (95, 95, 5)
    wm.on_preemption(blocks_in_use=97)
    assert wm.level == 95  # never above base
    wm.on_preemption(blocks_in_use=40)
    assert (wm.level, wm.reserve) == (40, 60)
    wm.on_release(30)
    wm.on_release(30)
    assert wm.level == 95
    fixed = AdmissionWatermark.for_pool(100, 0.05, adaptive=False)
    fixed.on_preemption(10)
    assert fixed.level == 95
