"""The Ray Serve adapter, without a cluster: the router class as Serve deserializes it from the
deployment config, fed fake replicas that only have the attributes Serve's RunningReplica has."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import pytest
from ray.serve._private.common import (
    DeploymentHandleSource,
    DeploymentID,
    ReplicaID,
    RequestMetadata,
)
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest

from deployments.config import RouterArgs
from deployments.request_router import (
    request_block_hashes,
    request_directory_hashes,
    request_session,
)
from deployments.request_router_config import request_router_config
from router.slo import VERDICTS
from tests.router.support import report

DEPLOYMENT = DeploymentID(name="Engine", app_name="prefixserve")
H = list(range(700, 730))


class FakeReplica:
    """Only what a request router reads from a ``RunningReplica``."""

    def __init__(self, unique_id: str, stats: dict[str, Any] | None = None) -> None:
        self.replica_id = ReplicaID(unique_id, DEPLOYMENT)
        self.routing_stats = stats or {}
        self.max_ongoing_requests = 256
        self.node_id = "node"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


@dataclass
class EngineRequest:
    """Stands in for the ingress's request object: read by attribute, never by type."""

    prompt_token_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    session_id: str | None = None
    request_id: str = "req"
    tbt_slo_ms: float | None = None


def pending(arg: Any, request_id: str = "r1", session_id: str = "") -> PendingRequest:
    return PendingRequest(
        args=[arg],
        kwargs={},
        metadata=RequestMetadata(
            request_id=request_id, internal_request_id=request_id, session_id=session_id
        ),
    )


def build_router(config: RequestRouterConfig) -> Any:
    """The config's router class, constructed as Serve's Router constructs it (its state is
    not initialized)."""
    router_cls = config.get_request_router_class()  # cloudpickled by value, as Serve ships it
    return router_cls(
        deployment_id=DEPLOYMENT,
        handle_source=DeploymentHandleSource.REPLICA,
        use_replica_queue_len_cache=True,
        # What Serve's Router passes besides; a router must accept and ignore them.
        self_node_id="node",
        prefer_local_node_routing=False,
        prefer_local_az_routing=False,
        self_availability_zone=None,
    )


def make_router(policy: str = "prefix_aware", kv_sharing: bool = False, **router_args: Any) -> Any:
    config = request_router_config(
        policy, RouterArgs(**router_args).model_dump(), 0.5, kv_sharing=kv_sharing
    )
    router = build_router(config)
    router.initialize_state(**config.request_router_kwargs)
    return router


def run(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
    """Run an async test body: Serve's router needs a running loop (update_replicas starts probe
    tasks, a PendingRequest creates a future)."""
    asyncio.run(test())


async def settle() -> None:
    await asyncio.sleep(0)  # let the queue-length probes of new replicas run


def ids(ranks: list[list[Any]]) -> list[list[str]]:
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


def test_request_router_config() -> None:
    config = request_router_config("power_of_two", {"imbalance_abs": 3, "stats_period_s": 9}, 0.5)
    assert isinstance(config, RequestRouterConfig)
    assert config.request_router_class == "deployments.request_router.PowerOfTwoRequestRouter"
    assert config.request_routing_stats_period_s == 0.5
    assert config.request_router_kwargs["imbalance_abs"] == 3
    assert "stats_period_s" not in config.request_router_kwargs
    assert config.get_request_router_class().policy_name == "power_of_two"
    with pytest.raises(ValueError, match="unknown routing policy"):
        request_router_config("random", {}, 1.0)
    with pytest.raises(ValueError, match="imbalance_rel"):
        request_router_config("prefix_aware", {"imbalance_rel": 0.5}, 1.0)


def test_block_hashes_are_read_by_attribute_or_key() -> None:
    async def body() -> None:
        assert request_block_hashes(pending(EngineRequest(block_hashes=[1, 2]))) == [1, 2]
        assert request_block_hashes(pending({"block_hashes": [3]})) == [3]
        assert request_block_hashes(pending("just a prompt")) == []
        assert request_block_hashes(None) == []
        directory = request_directory_hashes(pending({"directory_block_hashes": [4]}))
        assert directory == frozenset({4})
        assert request_directory_hashes(pending(EngineRequest())) is None

    run(body)


def test_the_session_is_read_from_the_request_or_from_serve() -> None:
    async def body() -> None:
        assert request_session(pending(EngineRequest(session_id="s1"))) == "s1"
        assert request_session(pending({"session_id": "s2"})) == "s2"
        # Serve's own session id (its x-session-id header), when the request names none.
        assert request_session(pending(EngineRequest(), session_id="s3")) == "s3"
        assert request_session(pending(EngineRequest(session_id="s1"), session_id="s3")) == "s1"
        assert request_session(pending(EngineRequest())) is None
        assert request_session(None) is None

    run(body)


def test_a_sessions_next_turn_follows_its_first_choice() -> None:
    async def body() -> None:
        router = make_router()
        now = time.time()
        replicas = [FakeReplica(r, report(r, [], at=now)) for r in ("a", "b", "c", "d")]
        router.update_replicas(replicas)
        await settle()
        homes = {}
        for s in range(6):
            turn1 = pending(EngineRequest(block_hashes=[s * 10 + 1], session_id=f"s{s}"), f"t1-{s}")
            homes[s] = ids(await router.choose_replicas(replicas, turn1))[0][0]
            router.on_request_completed(None, f"t1-{s}")  # never routed by Serve: ranked only
        for s in range(6):
            # Nothing shared with turn 1: only the session can bring the turn back.
            turn2 = pending(EngineRequest(block_hashes=[s * 10 + 2], session_id=f"s{s}"), f"t2-{s}")
            assert ids(await router.choose_replicas(replicas, turn2))[0][0] == homes[s]
            # Turns of a conversation come one at a time: no turn waits on its replica.
            router.on_request_completed(None, f"t2-{s}")
        assert router.policy.counters["session"] == 6

    run(body)


def test_prefix_affinity_and_decision_hooks() -> None:
    async def body() -> None:
        router = make_router(imbalance_abs=100)
        now = time.time()
        a = FakeReplica("a", report("a", H, at=now))
        b = FakeReplica("b", report("b", [], at=now))
        c = FakeReplica("c")  # not polled yet: empty routing stats
        router.update_replicas([a, b, c])
        await settle()

        request = pending(EngineRequest(block_hashes=H[:20]), "r1")
        ranks = ids(await router.choose_replicas([a, b, c], request))
        assert ranks[0] == ["a"]
        assert sorted(ranks[1:]) == [["b"], ["c"]]
        assert request.routing_context.should_backoff

        # Serve's order on acceptance: the queue length (counting this request), then routed.
        router.on_new_queue_len_info(b.replica_id, 1)
        router.on_request_routed(pending({"block_hashes": H[:20]}, "r2"), b.replica_id, None)
        view_b = router.policy.view("b")
        assert view_b.estimated_load == 1  # not 2: the queue length already counted r2
        assert view_b.matched_blocks(H, time.time(), 30.0) == 20
        router.on_request_completed(b.replica_id, "r2")
        assert view_b.num_in_flight == 0
        router.on_request_completed(b.replica_id, "never-routed")  # rejected: ignored

    run(body)


def test_a_handed_off_request_goes_where_its_inter_token_slo_is_kept() -> None:
    async def body() -> None:
        router = make_router(imbalance_abs=100)
        now = time.time()
        # a holds the prompt's KV but decodes 8 streams at 40 ms a step; b decodes one at 20.
        a = FakeReplica("a", {**report("a", H, at=now, running=8), "decode_step_s": 0.040})
        b = FakeReplica("b", {**report("b", [], at=now, running=1), "decode_step_s": 0.020})
        router.update_replicas([a, b])
        await settle()
        plain = EngineRequest(block_hashes=H[:20], request_id="p")
        assert ids(await router.choose_replicas([a, b], pending(plain, "p")))[0] == ["a"]
        assert VERDICTS.take("p") is None  # no SLO: neither reordered nor counted
        # Nobody decodes within 5 ms: the best by the policy still gets it, as a miss.
        missed = EngineRequest(block_hashes=H[:20], request_id="m-decode", tbt_slo_ms=5.0)
        assert ids(await router.choose_replicas([a, b], pending(missed, "m")))[0] == ["a"]
        assert VERDICTS.take("m-decode") is False
        kept = EngineRequest(block_hashes=H[:20], request_id="k-decode", tbt_slo_ms=44.0)
        assert ids(await router.choose_replicas([a, b], pending(kept, "k")))[0] == ["b"]
        assert VERDICTS.take("k-decode") is True

    run(body)


def test_missing_prefix_information_falls_back_to_power_of_two() -> None:
    async def body() -> None:
        router = make_router(evict_oldest=False)
        replicas = [FakeReplica("a"), FakeReplica("b")]
        router.update_replicas(replicas)
        await settle()
        ranks = await router.choose_replicas(replicas, pending({"messages": []}))
        assert sorted(ids(ranks)) == [["a"], ["b"]]
        assert router.policy.counters == {"fallback": 1}

    run(body)


def test_replica_removal_and_death_reach_the_policy() -> None:
    async def body() -> None:
        router = make_router()
        a, b = FakeReplica("a", report("a", H, at=time.time())), FakeReplica("b")
        router.update_replicas([a, b])
        await settle()
        assert router.policy.view("a") is not None
        router.update_replicas([b])
        await settle()
        assert router.policy.view("a") is None
        router.on_replica_actor_died(b.replica_id)
        assert router.policy.view("b") is None

    run(body)


def test_failures_inside_the_policy_never_escape() -> None:
    async def body() -> None:
        router = make_router()
        a = FakeReplica("a", report("a", H, at=time.time()))
        b = FakeReplica("b", {"reported_at": "garbage"})  # malformed stats: logged, ignored
        router.update_replicas([a, b])
        await settle()
        request = pending(EngineRequest(block_hashes=H))
        assert ids(await router.choose_replicas([a, b], request))[0] == ["a"]

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("bug")

        router.policy.rank = broken
        ranks = await router.choose_replicas([a, b], request)
        assert len(ranks) == 1
        assert sorted(r.replica_id.unique_id for r in ranks[0]) == ["a", "b"]
        assert request.routing_context.should_backoff
        assert await router.choose_replicas([], request) == []

    run(body)


@pytest.mark.parametrize("policy", ["power_of_two", "round_robin"])
def test_other_policies_rank_every_replica(policy: str) -> None:
    async def body() -> None:
        router = make_router(policy)
        replicas = [FakeReplica(x) for x in "abc"]
        router.update_replicas(replicas)
        await settle()
        request = pending(EngineRequest(block_hashes=H))
        assert sorted(ids(await router.choose_replicas(replicas, request))) == [["a"], ["b"], ["c"]]
        assert router.policy.name == policy

    run(body)


def test_replicas_believed_full_are_tried_last() -> None:
    async def body() -> None:
        # Weights under which the cache alone decides, so only fullness can demote "a".
        router = make_router(load_cost_per_request=0.001, imbalance_abs=10_000)
        now = time.time()
        a = FakeReplica("a", report("a", H, at=now, running=3))
        b = FakeReplica("b", report("b", [], at=now))
        a.max_ongoing_requests = 4
        router.update_replicas([a, b])
        await settle()
        request = pending(EngineRequest(block_hashes=H))
        assert ids(await router.choose_replicas([a, b], request)) == [["a"], ["b"]]
        router.on_request_routed(pending({"block_hashes": H}, "r2"), a.replica_id, None)
        assert ids(await router.choose_replicas([a, b], request)) == [["b"], ["a"]]

    run(body)


@pytest.mark.parametrize("kv_sharing", [False, True])
def test_kv_sharing_lets_an_idle_replica_import_a_busy_holders_prefix(kv_sharing: bool) -> None:
    """With KV sharing, a prefix cached on a busy replica costs only its transfer elsewhere."""

    async def body() -> None:
        router = make_router(kv_sharing=kv_sharing, imbalance_abs=100, load_cost_per_request=4.0)
        now = time.time()
        a = FakeReplica("a", report("a", H, at=now, running=5))
        b = FakeReplica("b", report("b", [], at=now))
        router.update_replicas([a, b])
        await settle()
        ranks = ids(await router.choose_replicas([a, b], pending(EngineRequest(block_hashes=H))))
        # 30 blocks: prefill 30 vs transfer 7.5 on b; a's load of 5 costs 20.
        assert ranks[0] == (["b"] if kv_sharing else ["a"])

    run(body)


def test_a_burst_ranked_before_any_acceptance_splits_evenly() -> None:
    """Serve ranks a burst before any replica accepts a request: each first choice must count at
    once, or every request sees the same loads and the burst splits at random."""

    async def body() -> None:
        for seed in range(5):
            router = make_router()
            router.policy.rng.seed(seed)
            replicas = [FakeReplica("a"), FakeReplica("b")]
            router.update_replicas(replicas)
            await settle()
            firsts = []
            for i in range(64):  # distinct prompts, nothing cached: two choices on load
                request = pending(EngineRequest(block_hashes=[10_000 + i]), f"r{i}")
                firsts.append(ids(await router.choose_replicas(replicas, request))[0][0])
            assert abs(firsts.count("a") - firsts.count("b")) <= 1

    run(body)


def test_serve_placing_a_request_elsewhere_moves_its_tentative_load() -> None:
    async def body() -> None:
        router = make_router()
        a, b = FakeReplica("a"), FakeReplica("b")
        router.update_replicas([a, b])
        await settle()
        request = pending(EngineRequest(block_hashes=H[:4]), "r1")
        first = ids(await router.choose_replicas([a, b], request))[0][0]
        other = b if first == "a" else a
        assert router.policy.view(first).num_in_flight == 1
        router.on_request_routed(request, other.replica_id, None)  # the first choice was full
        assert router.policy.view(first).num_in_flight == 0
        assert router.policy.view(other.replica_id.unique_id).num_in_flight == 1
        router.on_request_completed(other.replica_id, "r1")
        assert router.policy.view(other.replica_id.unique_id).num_in_flight == 0
        # Accepted where it was ranked: counted once, not twice.
        second = pending(EngineRequest(block_hashes=H[:4]), "r2")
        first = ids(await router.choose_replicas([a, b], second))[0][0]
        chosen = a if first == "a" else b
        router.on_request_routed(second, chosen.replica_id, None)
        assert router.policy.view(first).num_in_flight == 1

    run(body)


def test_a_ranked_request_never_placed_stops_counting(monkeypatch: pytest.MonkeyPatch) -> None:
    async def body() -> None:
        router = make_router()
        a, b = FakeReplica("a"), FakeReplica("b")
        router.update_replicas([a, b])
        await settle()
        clock = [1000.0]
        monkeypatch.setattr("time.time", lambda: clock[0])
        cancelled = pending(EngineRequest(block_hashes=[1]), "cancelled")
        first = ids(await router.choose_replicas([a, b], cancelled))[0][0]
        assert router.policy.view(first).num_in_flight == 1
        clock[0] += 60.0  # the client went away before any replica accepted the request
        await router.choose_replicas([a, b], pending(EngineRequest(block_hashes=[2]), "next"))
        assert router.policy.state.in_flight("cancelled") is None
        assert sum(router.policy.view(k).num_in_flight for k in "ab") == 1  # only "next"

    run(body)
