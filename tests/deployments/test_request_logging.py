"""Request ids in log records, and the engine stats line (no Serve here: Ray's own formatters
and a real logger)."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from ray._common.formatters import JSONFormatter

from deployments import request_logging
from deployments.stats_log import EngineStatsLog
from engine.llm_engine import EngineStats


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def logger() -> tuple[logging.Logger, Capture]:
    log = logging.getLogger("prefixserve-test-request-ids")
    log.propagate = False
    log.setLevel(logging.INFO)
    capture = Capture()
    log.handlers = [capture]
    log.filters = []
    request_logging.install(log.name)
    request_logging.install(log.name)  # idempotent
    assert len(log.filters) == 1
    return log, capture


def test_ids_reach_every_record_of_their_request_only(logger) -> None:
    log, capture = logger

    async def serve(response_id: str, x_request_id: str, gate: asyncio.Event) -> None:
        request_logging.bind(x_request_id=x_request_id)
        log.info("before the body is parsed")
        request_logging.bind(response_id=response_id)
        await gate.wait()  # the other request runs in between
        await asyncio.create_task(asyncio.sleep(0))
        # A task the request spawns carries its ids.
        await asyncio.create_task(_log_later(log, "from a spawned task"))
        log.info("done %s", "here")

    async def main() -> None:
        gate = asyncio.Event()
        first = asyncio.create_task(serve("cmpl-1", "req-a", gate))
        second = asyncio.create_task(serve("chatcmpl-2", "req-b", gate))
        await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(first, second)
        log.info("outside any request")

    asyncio.run(main())
    lines = [r.getMessage() for r in capture.records]
    assert "[x-request-id=req-a] before the body is parsed" in lines
    assert "[cmpl-1 x-request-id=req-a] from a spawned task" in lines
    assert "[cmpl-1 x-request-id=req-a] done here" in lines
    assert "[chatcmpl-2 x-request-id=req-b] done here" in lines
    assert "outside any request" in lines
    for record in capture.records:
        if "cmpl-1" in record.getMessage():
            assert (record.response_id, record.x_request_id) == ("cmpl-1", "req-a")
        assert "req-b" not in record.getMessage() or "cmpl-1" not in record.getMessage()


async def _log_later(log: logging.Logger, message: str) -> None:
    await asyncio.sleep(0)
    log.info(message)


def test_json_encoding_has_the_ids_as_keys(logger) -> None:
    log, capture = logger
    with request_logging.bound(response_id="cmpl-9", x_request_id="abc"):
        log.warning("slow step")
    log.warning("after")
    first, after = (json.loads(JSONFormatter().format(r)) for r in capture.records)
    assert first["response_id"] == "cmpl-9" and first["x_request_id"] == "abc"
    assert first["levelname"] == "WARNING" and first["message"].endswith("slow step")
    assert "response_id" not in after and after["message"] == "after"


def stats(**values: float) -> EngineStats:
    s = EngineStats()
    for key, value in values.items():
        setattr(s, key, value)
    return s


def test_stats_line_rates_over_the_interval() -> None:
    log = logging.getLogger("prefixserve-test-stats")
    out = EngineStatsLog(5.0, log)
    assert out.maybe_log(stats(), now=0.0) is None  # the baseline
    busy = stats(
        num_running=3, num_waiting=1, kv_usage=0.25, prompt_tokens=400,
        cache_hit_tokens_local=100, cache_hit_tokens_remote=100, generation_tokens=500,
    )  # fmt: skip
    assert out.maybe_log(busy, now=4.0) is None  # not due yet
    line = out.maybe_log(busy, now=5.0)
    assert line == (
        "engine stats: running=3 waiting=1 kv_usage=25.0% prefix_hit_ratio=50.0% "
        "prompt_tok/s=80.0 generation_tok/s=100.0 preemptions=0"
    )
    # Going idle is reported once; an idle replica then stays quiet.
    idle = stats(prompt_tokens=400, cache_hit_tokens_local=200, generation_tokens=500)
    assert out.maybe_log(idle, now=10.0) == (
        "engine stats: running=0 waiting=0 kv_usage=0.0% prefix_hit_ratio=0.0% "
        "prompt_tok/s=0.0 generation_tok/s=0.0 preemptions=0"
    )
    assert out.maybe_log(idle, now=20.0) is None
