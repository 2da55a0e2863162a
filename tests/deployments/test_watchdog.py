"""A stalled engine thread: the replica's watchdog ends its streams with an error event, and Serve
replaces the replica.

The stall comes from the fault-injection hook (``deployments.fault_injection``): the deployment's
environment names a trigger file, and the replica whose id the test writes into it stops
stepping, as a wedged kernel would. Both layouts: the shipped (direct) one, where the engine
replica writes the SSE stream itself and so must get the error event out before it exits, and the
routed one, where the ingress relays the replica's error item.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from deployments.fault_injection import STALL_FILE_ENV, install_stall_hook
from tests.deployments.conftest import deploy, undeploy
from tests.deployments.support import engine_replica_ids, scrape
from tests.deployments.test_faults import StreamLog, open_streams, short_request

STALL_BOUND_S = 5.0
# Acceptance: a stalled replica's streams end with an error event within this.
ERROR_WITHIN_S = 30.0
REPLACED_WITHIN_S = 120.0
STREAMS = 6


# -- the hook, without a cluster -----------------------------------------------------------------


class FakeEngine:
    def __init__(self) -> None:
        self.steps = 0

    def step(self) -> list:
        self.steps += 1
        return []


def test_the_stall_hook_is_off_unless_the_environment_names_a_file(tmp_path: Path) -> None:
    engine = FakeEngine()
    assert not install_stall_hook(engine, "r1", environ={})  # type: ignore[arg-type]
    assert "step" not in vars(engine)  # the class's own step, untouched


def test_the_stall_hook_stalls_only_the_named_replica_while_the_file_names_it(
    tmp_path: Path,
) -> None:
    trigger = tmp_path / "stall"
    env = {STALL_FILE_ENV: str(trigger)}
    engine = FakeEngine()
    assert install_stall_hook(engine, "r1", environ=env)  # type: ignore[arg-type]
    engine.step()  # no file: no stall
    trigger.write_text("r2")
    engine.step()  # another replica's name
    assert engine.steps == 2
    trigger.write_text("r1")

    async def stalled_then_released() -> float:
        start = time.monotonic()
        step = asyncio.create_task(asyncio.to_thread(engine.step))
        await asyncio.sleep(0.5)
        assert not step.done() and engine.steps == 2  # stalled before the real step
        trigger.unlink()
        await asyncio.wait_for(step, 5.0)
        return time.monotonic() - start

    assert asyncio.run(stalled_then_released()) >= 0.5
    assert engine.steps == 3


# -- against a real Serve deployment -------------------------------------------------------------


@pytest.fixture(scope="module")
def stall_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stall") / "stall-replica"


@pytest.fixture(scope="module", params=["direct", "routed"])
def base_url(
    request: pytest.FixtureRequest,
    serve_instance: str,
    tiny_llama_with_tokenizer: Path,
    stall_file: Path,
) -> Iterator[str]:
    deploy(
        serve_instance,
        {
            "model": str(tiny_llama_with_tokenizer),
            "served_model_name": "tiny",
            "engine": {"dtype": "float32", "num_kv_blocks": 512, "max_num_seqs": 16},
            # Cache affinity outweighs load here, so that the streams share one replica.
            "router": {"load_cost_per_request": 0.25, "imbalance_abs": 64},
            "stream_interval_ms": 5,
            "engine_stall_timeout_s": STALL_BOUND_S,
        },
        engine_options={
            "ray_actor_options": {
                "num_cpus": 0.5,
                "runtime_env": {"env_vars": {STALL_FILE_ENV: str(stall_file)}},
            }
        },
        layout=request.param,
    )
    yield serve_instance
    stall_file.unlink(missing_ok=True)
    undeploy()


async def streams_then_stall(base_url: str, stall_file: Path) -> tuple[list[StreamLog], float]:
    """Open STREAMS long streams sharing PREFIX; once each has produced tokens, stall the replica
    serving most of them; return the streams' logs once they have all ended."""
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        logs, tasks, victim = await open_streams(client, STREAMS)
        stall_file.write_text(victim)
        stalled_at = time.monotonic()
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=ERROR_WITHIN_S + 30)
        return logs, stalled_at


def wait_for_new_replica(base_url: str, before: set[str], deadline_s: float) -> str:
    """Wait until /health is ok with two running replicas, one of them new, and the new one
    serves a request; return its id."""
    start = time.monotonic()
    rng = random.Random(5)

    async def batch(client: httpx.AsyncClient) -> set[str]:
        rs = await asyncio.gather(*(short_request(client, rng) for _ in range(6)))
        assert [r.status_code for r in rs] == [200] * len(rs), [r.text for r in rs]
        return {r.headers["x-engine-replica"] for r in rs}

    async def run() -> str:
        async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
            while time.monotonic() - start < deadline_s:
                health = await client.get("/health")
                if health.status_code == 200 and health.json()["replicas"].get("RUNNING") == 2:
                    new = set(health.json()["healthy_replicas"]) - before
                    if new and (await batch(client)) & new:
                        return new.pop()
                await asyncio.sleep(1.0)
        raise AssertionError(f"no new replica serving after {deadline_s:.0f} s")

    return asyncio.run(run())


@pytest.mark.ray
def test_a_stalled_engine_thread_ends_its_streams_with_an_error_and_is_replaced(
    base_url: str, stall_file: Path
) -> None:
    before = engine_replica_ids(scrape(base_url))
    assert len(before) == 2
    logs, stalled_at = asyncio.run(streams_then_stall(base_url, stall_file))
    replicas = [log.replica for log in logs]
    victim = max(set(replicas), key=replicas.count)
    hit = [log for log in logs if log.replica == victim]
    for log in hit:
        # An OpenAI-style error event, then [DONE]: not a truncated stream.
        assert log.error is not None, log.events[-3:]
        assert log.error["code"] == "engine_failed" and "stalled" in log.error["message"]
        assert log.done and log.events[-1] == "[DONE]"
        assert log.error_at is not None
        # After the bound (the watchdog, not something else), well within the acceptance bound.
        assert STALL_BOUND_S * 0.8 <= log.error_at - stalled_at <= ERROR_WITHIN_S
    for log in logs:
        if log.replica != victim:
            assert log.error is None and log.finish_reason == "length"

    new = wait_for_new_replica(base_url, before, REPLACED_WITHIN_S)
    assert new not in before
    deadline = time.monotonic() + 40
    while victim in engine_replica_ids(scrape(base_url)):  # the registry forgets the dead one
        assert time.monotonic() < deadline
        time.sleep(1)
    ends = [log.error_at - stalled_at for log in hit if log.error_at is not None]
    print(
        f"\nstall: {len(hit)} streams on {victim} ended with an error event "
        f"{min(ends):.1f}-{max(ends):.1f} s after the stall (bound {STALL_BOUND_S:g} s); "
        f"replacement {new} serving after {time.monotonic() - stalled_at:.0f} s"
    )
