"""The step-level engine: add_request / step / abort, and a random-operations state machine."""

from __future__ import annotations

import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from engine import LLM, LLMEngine, RequestStatus, SamplingParams
from tests.engine.helpers import make_engine
from tests.engine.helpers import random_tokens as tokens


def run_to_completion(engine: LLMEngine, max_steps: int = 500) -> list:
    deltas = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return deltas
        deltas += engine.step()
    raise AssertionError("engine did not drain")


def test_add_request_does_no_model_work(tiny_llama):
    engine = make_engine(tiny_llama)
    request = engine.add_request("a", tokens(40, 0), SamplingParams(max_tokens=3))
    assert request.status == RequestStatus.WAITING
    assert request.num_computed_tokens == 0
    assert engine.stats.num_steps == 0
    assert engine.kv.pool.num_free_blocks == engine.num_blocks
    assert engine.kv.block_ids("a") == []
    assert engine.has_unfinished_requests()


def test_step_returns_per_request_deltas(tiny_llama):
    engine = make_engine(tiny_llama, max_num_batched_tokens=32)
    engine.add_request("short", tokens(5, 1), SamplingParams(max_tokens=3, temperature=0.0))
    engine.add_request("long", tokens(60, 2), SamplingParams(max_tokens=2, temperature=0.0))
    first = engine.step()
    # long's prefill is split across steps: it yields nothing until it samples.
    assert [d.request_id for d in first] == ["short"]
    (d,) = first
    assert len(d.new_token_ids) == 1 and not d.finished and d.finish_reason is None
    assert (d.num_prompt_tokens, d.num_output_tokens, d.num_cached_tokens) == (5, 1, 0)
    assert d.new_text == ""  # no tokenizer
    seen: dict[str, list[int]] = {"short": list(d.new_token_ids), "long": []}
    finals = {}
    for delta in run_to_completion(engine):
        assert len(delta.new_token_ids) == 1
        seen[delta.request_id] += delta.new_token_ids
        assert delta.num_output_tokens == len(seen[delta.request_id])
        if delta.finished:
            finals[delta.request_id] = delta
    assert {k: len(v) for k, v in seen.items()} == {"short": 3, "long": 2}
    assert {k: d.finish_reason for k, d in finals.items()} == {"short": "length", "long": "length"}
    assert engine.stats.generation_tokens == 5
    assert engine.stats.finished["length"] == 2
    assert engine.kv.pool.num_free_blocks == engine.num_blocks


def test_text_deltas_concatenate_to_the_decoded_output(tiny_llama_with_tokenizer):
    engine = make_engine(tiny_llama_with_tokenizer)
    tok = engine.tokenizer
    engine.add_request("a", "Once upon a time", SamplingParams(max_tokens=12, temperature=0.0))
    deltas = run_to_completion(engine)
    ids = [t for d in deltas for t in d.new_token_ids]
    text = "".join(d.new_text for d in deltas)
    assert text == tok.decode(ids, skip_special_tokens=True)
    assert deltas[-1].finished and all(not d.finished for d in deltas[:-1])


def test_abort_frees_every_block(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, max_num_seqs=2)
    shared = tokens(16, 3)
    for i in range(3):
        engine.add_request(str(i), shared + tokens(6, 10 + i), SamplingParams(max_tokens=50))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 1
    assert engine.kv.pool.num_free_blocks < engine.num_blocks
    assert engine.abort_request("0")  # running, sharing prefix blocks with "1"
    engine.kv.pool.check_invariants()
    assert engine.abort_request("2")  # waiting
    assert engine.abort_request("1")
    assert not engine.abort_request("1")
    assert not engine.abort_request("unknown")
    assert not engine.has_unfinished_requests()
    pool = engine.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert engine.kv.req_blocks == {}
    pool.check_invariants()
    assert engine.stats.finished["abort"] == 3
    assert engine.step() == []


def test_finished_request_cannot_be_aborted(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request("a", tokens(3, 4), SamplingParams(max_tokens=1))
    (delta,) = engine.step()
    assert delta.finished
    assert not engine.abort_request("a")
    # Its id may be reused once it has finished.
    engine.add_request("a", tokens(3, 4), SamplingParams(max_tokens=1))


def test_duplicate_request_id_is_rejected(tiny_llama):
    engine = make_engine(tiny_llama)
    engine.add_request("a", tokens(3, 5))
    with pytest.raises(ValueError, match="^request_id:"):
        engine.add_request("a", tokens(3, 6))


def test_prefix_hits_are_reported(tiny_llama):
    engine = make_engine(tiny_llama, block_size=8)
    prompt = tokens(30, 7)
    engine.add_request("a", prompt, SamplingParams(max_tokens=1))
    (first,) = run_to_completion(engine)
    engine.add_request("b", prompt + [5], SamplingParams(max_tokens=1))
    (second,) = run_to_completion(engine)
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 24)
    assert engine.stats.cache_hit_tokens_local == 24
    assert engine.stats.prompt_tokens == 61


def test_cache_salt_keeps_requests_apart(tiny_llama):
    """Same prompt: the same cache salt shares its cached blocks, another salt or none does not,
    and the salted requests' tokens are the unsalted ones (the salt only names the blocks)."""
    engine = make_engine(tiny_llama, block_size=8)
    prompt = tokens(30, 8)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    cached, outputs = {}, {}
    for rid, salt in [("a1", "a"), ("b1", "b"), ("none", None), ("a2", "a"), ("b2", "b")]:
        engine.add_request(rid, prompt, params, cache_salt=salt)
        deltas = run_to_completion(engine)
        cached[rid] = deltas[-1].num_cached_tokens
        outputs[rid] = [t for d in deltas for t in d.new_token_ids]
    assert cached == {"a1": 0, "b1": 0, "none": 0, "a2": 24, "b2": 24}
    assert len({tuple(o) for o in outputs.values()}) == 1


# -- random operations -----------------------------------------------------------------------------

PREFIXES = [[], tokens(9, 100), tokens(17, 101)]


class EngineMachine(RuleBasedStateMachine):
    """Random add / step / abort sequences on a small KV pool (preemption is frequent), with or
    without a per-group cap on a step's sequences (``max_seqs_per_group``), with the serial step
    loop or the overlapped one (``async_scheduling``).

    Every finished request's tokens must equal what a roomy engine without prefix caching or
    preemption generates for it: preemption, prefix hits and aborts must never corrupt KV."""

    model_dir: str = ""
    reference: LLM | None = None
    live = Bundle("live")

    def __init__(self) -> None:
        super().__init__()
        self.engine: LLMEngine | None = None
        self.added: dict[str, SamplingParams] = {}
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.aborted: set[str] = set()
        self.next_id = 0

    @initialize(
        policy=st.sampled_from(["fcfs", "priority", "deadline", "shortest_prompt"]),
        caching=st.booleans(),
        group_cap=st.sampled_from([None, 1, 2]),
        overlap=st.booleans(),
    )
    def start(self, policy: str, caching: bool, group_cap: int | None, overlap: bool) -> None:
        self.engine = make_engine(
            self.model_dir,
            block_size=4,
            num_kv_blocks=12,
            max_num_seqs=4,
            max_num_batched_tokens=24,
            scheduling_policy=policy,
            enable_prefix_caching=caching,
            max_seqs_per_group=group_cap,
            async_scheduling=overlap,
        )

    @rule(
        target=live,
        specs=st.lists(
            st.tuples(
                st.sampled_from(range(len(PREFIXES))),
                st.lists(st.integers(3, 511), min_size=1, max_size=16),
                st.integers(1, 12),
                st.integers(0, 3),
                st.sampled_from([None, 0.001, 50.0, 1e6]),
                st.sampled_from([None, "g0", "g1"]),
            ),
            min_size=1,
            max_size=4,
        ),
    )
    def add(
        self, specs: list[tuple[int, list[int], int, int, float | None, str | None]]
    ) -> MultipleResults[str]:
        rids = []
        for prefix, suffix, max_tokens, priority, deadline_ms, group in specs:
            rid = f"r{self.next_id}"
            self.next_id += 1
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            self.prompts[rid] = PREFIXES[prefix] + suffix
            self.engine.add_request(
                rid,
                self.prompts[rid],
                params,
                priority=priority,
                deadline_ms=deadline_ms,
                group_id=group,
            )
            self.added[rid] = params
            self.outputs[rid] = []
            rids.append(rid)
        return multiple(*rids)

    @rule()
    def step(self) -> None:
        self._apply(self.engine.step())

    @rule(steps=st.integers(2, 8))
    def run_a_while(self, steps: int) -> None:
        for _ in range(steps):
            self._apply(self.engine.step())

    @rule(rid=consumes(live))
    def abort(self, rid: str) -> None:
        was_live = rid not in self.finished
        assert self.engine.abort_request(rid) == was_live
        if was_live:
            self.aborted.add(rid)

    def _apply(self, deltas: list) -> None:
        for d in deltas:
            assert d.request_id in self.added
            assert d.request_id not in self.finished and d.request_id not in self.aborted
            self.outputs[d.request_id] += d.new_token_ids
            assert d.num_output_tokens == len(self.outputs[d.request_id])
            assert d.num_output_tokens <= self.added[d.request_id].max_tokens
            if d.finished:
                self.finished[d.request_id] = d.finish_reason
                # An EOS wins over max_tokens when it is the last token (as in vLLM).
                eos = d.new_token_ids[-1] in self.engine.eos_token_ids
                length = d.num_output_tokens == self.added[d.request_id].max_tokens
                assert d.finish_reason == ("length" if length and not eos else "stop"), d

    @invariant()
    def pool_is_consistent(self) -> None:
        if self.engine is None:
            return
        kv = self.engine.kv
        kv.pool.check_invariants()
        # Every block's ref count is the number of requests holding it.
        holders = Counter(b.block_id for blocks in kv.req_blocks.values() for b in blocks)
        assert all(b.ref_cnt == holders[b.block_id] for b in kv.pool.blocks)
        scheduler = self.engine.scheduler
        assert set(scheduler.requests) == set(self.added) - set(self.finished) - self.aborted
        for request in scheduler.running:
            assert request.status == RequestStatus.RUNNING
            assert len(kv.req_blocks[request.request_id]) * 4 >= request.num_computed_tokens
        for request in scheduler.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.request_id not in kv.req_blocks

    def teardown(self) -> None:
        if self.engine is None:
            return
        self._apply(run_to_completion(self.engine))
        pool = self.engine.kv.pool
        pool.check_invariants()
        assert pool.num_free_blocks == pool.num_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert self.engine.kv.req_blocks == {}
        # No request is lost: each one finished or was aborted, never both.
        assert set(self.finished) | self.aborted == set(self.added)
        assert not set(self.finished) & self.aborted
        done = sorted(self.finished)
        if done and self.reference is not None:
            expected = self.reference.generate(
                [self.prompts[r] for r in done], [self.added[r] for r in done]
            )
            assert [self.outputs[r] for r in done] == [o.token_ids for o in expected]


def test_random_add_step_abort_sequences(tiny_llama):
    EngineMachine.model_dir = str(tiny_llama)
    EngineMachine.reference = LLM(
        model=str(tiny_llama), dtype="float32", num_kv_blocks=256, enable_prefix_caching=False
    )
    run_state_machine_as_test(
        EngineMachine,
        settings=settings(
            max_examples=30,
            stateful_step_count=20,
            deadline=None,
            derandomize=True,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )


@pytest.mark.parametrize("native_bf16", [True, False])
def test_auto_dtype_follows_the_cpus_bf16_support(monkeypatch, caplog, native_bf16):
    """``auto`` is bf16 only where the CPU computes in bf16 natively; elsewhere float32, and an
    explicit bf16 is honoured with a note that its larger matmuls run in float32."""
    import torch

    from engine import llm_engine

    monkeypatch.setattr(llm_engine, "cpu_has_bf16", lambda: native_bf16)
    cpu = torch.device("cpu")
    expected = torch.bfloat16 if native_bf16 else torch.float32
    assert llm_engine.resolve_dtype("auto", cpu) == expected
    assert llm_engine.resolve_dtype("float32", cpu) == torch.float32
    with caplog.at_level("INFO", logger="engine.llm_engine"):
        assert llm_engine.resolve_dtype("bfloat16", cpu) == torch.bfloat16
    noted = any("run in float32" in r.getMessage() for r in caplog.records)
    assert noted is not native_bf16


def test_decode_step_time_is_a_streams_inter_step_time(tiny_llama):
    """``stats.decode_step_s``: the time between the starts of consecutive steps a sequence
    decodes in; a step that follows an idle engine is no sample, whatever its rows."""
    engine = make_engine(tiny_llama)
    engine.add_request("a", tokens(40, 0), SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()  # the prefill: no decode row
    # The samples are intervals between the starts of a's decode steps, so they lie within the
    # time from before its first decode step to after its last one.
    started = time.perf_counter()
    engine.step()  # a's first decode: no earlier step decoded it
    assert engine.stats.decode_step_s is None
    engine.step()
    engine.step()
    elapsed = time.perf_counter() - started
    assert engine.stats.decode_step_s is not None
    assert 0 < engine.stats.decode_step_s < elapsed
    run_to_completion(engine)
    measured = engine.stats.decode_step_s
    time.sleep(0.3)
    # A one-token prompt's only step is a one-row step too, after the engine sat idle.
    engine.add_request("b", tokens(1, 1), SamplingParams(max_tokens=1, temperature=0.0))
    run_to_completion(engine)
    assert engine.stats.decode_step_s == measured
