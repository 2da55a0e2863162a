"""Fair share of a step among request groups (``engine.fair_share``): a wide group is capped only
while another group has work, its sequences take turns, and outputs do not change."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from engine import SamplingParams
from engine.request import Request
from engine.scheduler import SchedulerOutput
from tests.engine.helpers import make_engine
from tests.engine.helpers import random_tokens as tokens
from tests.engine.test_scheduler import BS, Sim
from tests.helpers import hf_greedy

_ids = itertools.count(5000)


def add(sim: Sim, rid: str, group: str | None, prompt_len: int = 3, max_tokens: int = 50) -> None:
    sim.clock += 1.0
    sim.sched.add_request(
        Request(
            rid,
            [next(_ids) for _ in range(prompt_len)],
            SamplingParams(max_tokens=max_tokens),
            arrival_time=sim.clock,
            block_size=BS,
            group_id=group,
        )
    )


def per_group(out: SchedulerOutput) -> Counter[str]:
    return Counter(r.group_id for r, _ in out.scheduled)


def test_a_wide_group_is_capped_while_another_group_has_work():
    sim = Sim(max_seqs_per_group=2)
    for k in range(6):
        add(sim, f"wide-{k}", "wide")
    add(sim, "alone", None)
    for _ in range(20):
        counts = per_group(sim.step())
        assert counts["wide"] == 2
        assert counts["alone"] == 1  # one sequence: never held back


def test_a_lone_group_is_never_capped():
    sim = Sim(max_seqs_per_group=2)
    for k in range(6):
        add(sim, f"wide-{k}", "wide")
    for _ in range(10):
        assert per_group(sim.step())["wide"] == 6


def test_the_cap_lifts_when_the_other_group_finishes():
    sim = Sim(max_seqs_per_group=2)
    for k in range(6):
        add(sim, f"wide-{k}", "wide", max_tokens=40)
    add(sim, "short", "short", max_tokens=5)
    counts = [per_group(sim.step()) for _ in range(8)]
    assert [c["wide"] for c in counts[:5]] == [2] * 5
    assert counts[4]["short"] == 1 and "short" not in sim.sched.requests
    assert [c["wide"] for c in counts[5:]] == [6] * 3


def test_rotation_gives_every_sequence_of_a_capped_group_progress():
    """Six sequences, two places a step: each waits at most a few steps for its next token and,
    once all have started, they advance at the same pace (within one token)."""
    sim = Sim(max_seqs_per_group=2)
    wide = [f"wide-{k}" for k in range(6)]
    for rid in wide:
        add(sim, rid, "wide", max_tokens=200)
    add(sim, "other", "other", max_tokens=200)
    last_progress = dict.fromkeys(wide, 0)

    def outputs() -> list[int]:
        return [sim.sched.requests[rid].num_output_tokens for rid in wide]

    for step in range(1, 61):
        for r, _ in sim.step().scheduled:
            last_progress[r.request_id] = step
        if step > 3:  # admission takes the first steps
            for rid in wide:
                assert step - last_progress[rid] < 6, (rid, step, last_progress)
        if step == 12:
            started = outputs()
            assert min(started) > 0 and sim.sched.num_waiting == 0
    gained = [after - before for after, before in zip(outputs(), started, strict=True)]
    assert sum(gained) == 2 * (60 - 12)
    assert max(gained) - min(gained) <= 1, gained


def test_waiting_members_of_a_capped_group_are_admitted_in_turn_and_others_go_past():
    """Only the cap's worth of a wide group starts at once; a later request of another group is
    admitted in the same step, and the rest of the wide group joins a slot a step."""
    sim = Sim(max_seqs_per_group=3)
    for k in range(5):
        add(sim, f"wide-{k}", "wide")
    add(sim, "late", None)
    first = sim.step()
    assert {r.request_id for r, _ in first.scheduled} == {"wide-0", "wide-1", "wide-2", "late"}
    assert sim.sched.num_waiting == 2
    # Two slots for the waiting ones (one stays with the running ones): both join next step.
    second = per_group(sim.step())
    assert second["wide"] == 3 and sim.sched.num_waiting == 0


@pytest.mark.parametrize("cap", [None, 1])
def test_a_wide_groups_prefill_chunks_leave_room_for_another_group(cap):
    """Without the cap the wide group's prompts fill the token budget and the later request
    waits for a step; with it, the later request's prompt is computed in the first step."""
    sim = Sim(max_num_batched_tokens=12, max_seqs_per_group=cap)
    for k in range(4):
        add(sim, f"wide-{k}", "wide", prompt_len=6)
    add(sim, "late", None, prompt_len=6)
    first = {r.request_id: n for r, n in sim.step().scheduled}
    if cap is None:
        assert first == {"wide-0": 6, "wide-1": 6}
    else:
        assert first == {"wide-0": 6, "late": 6}


def test_groups_of_one_sequence_schedule_exactly_as_without_the_cap():
    """n=1 traffic: the policy never binds, step by step."""
    sims = [Sim(max_num_batched_tokens=16), Sim(max_num_batched_tokens=16, max_seqs_per_group=1)]
    for sim in sims:
        for k in range(8):
            add(sim, f"r{k}", None, prompt_len=3 + 2 * k, max_tokens=6 + k)
    for _ in range(40):
        plans = [[(r.request_id, n) for r, n in sim.step().scheduled] for sim in sims]
        assert plans[0] == plans[1]
    assert not sims[1].sched.has_unfinished()


def test_skipped_sequences_keep_their_blocks_and_all_are_freed_at_the_end():
    sim = Sim(num_blocks=40, max_seqs_per_group=1)
    for k in range(4):
        add(sim, f"wide-{k}", "wide", prompt_len=6, max_tokens=12)
    add(sim, "other", "other", prompt_len=5, max_tokens=30)
    held: dict[str, int] = {}
    for _ in range(200):
        if not sim.sched.has_unfinished():
            break
        out = sim.step()
        ran = {r.request_id for r, _ in out.scheduled}
        for r in sim.sched.running:
            blocks = len(sim.kv.req_blocks[r.request_id])
            if r.request_id not in ran:
                # Sat this step out: nothing allocated, nothing freed.
                assert blocks == held[r.request_id]
            held[r.request_id] = blocks
    assert not sim.sched.has_unfinished()
    assert sim.kv.pool.num_free_blocks == sim.kv.pool.num_blocks
    assert sim.sched.fair_share.num_groups == 0


def test_preemption_under_the_cap_still_frees_every_block():
    sim = Sim(num_blocks=10, max_seqs_per_group=2)
    for k in range(4):
        add(sim, f"wide-{k}", "wide", prompt_len=5, max_tokens=10)
    add(sim, "other", "other", prompt_len=5, max_tokens=10)
    for _ in range(300):
        if not sim.sched.has_unfinished():
            break
        sim.step()
    assert not sim.sched.has_unfinished()
    assert sim.sched.num_preemptions_total > 0, "the pool should force preemption"
    assert sim.kv.pool.num_free_blocks == sim.kv.pool.num_blocks


@pytest.mark.parametrize("cap", [1, 2])
def test_greedy_outputs_under_the_cap_match_transformers(tiny_llama, cap):
    """Token-identical to transformers (and so to the uncapped engine) for every sequence of a
    capped group and of the stream beside it, while the cap did bind."""
    max_new = 16
    prompts = [tokens(n, seed) for seed, n in enumerate([7, 20, 33, 12, 5])]
    engine = make_engine(tiny_llama, max_seqs_per_group=cap)
    params = SamplingParams(max_tokens=max_new, temperature=0.0, min_tokens=max_new)
    for k, prompt in enumerate(prompts[:4]):
        engine.add_request(f"wide-{k}", prompt, params, group_id="wide")
    engine.add_request("other", prompts[4], params)
    schedule, widest = engine.scheduler.schedule, []

    def spy() -> SchedulerOutput:
        out = schedule()
        widest.append(per_group(out)["wide"])
        return out

    engine.scheduler.schedule = spy  # type: ignore[method-assign]
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert widest[:max_new] == [cap] * max_new  # capped while "other" ran
    assert max(widest) > cap  # alone afterwards
    expected = hf_greedy(tiny_llama, prompts, max_new)
    got = [outputs[f"wide-{k}"] for k in range(4)] + [outputs["other"]]
    assert got == expected
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
