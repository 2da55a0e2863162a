"""``/health``: whether every engine replica can serve, answered from a verdict kept fresh in the
background.

Working the verdict out takes a trip to every engine replica's latest report (through the
registry actor) and to Serve's controller (which is asked again only when the replicas may
have changed: :class:`EngineStatesCache`). Doing that per call let 100 concurrent probes take
seconds each and take slots from the replicas; here one refresher per HTTP-serving replica does
it about once a second, and a call reads the result. A body never carries an exception's name
or message: those go to the log.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ray import serve

logger = logging.getLogger("ray.serve")

Verdict = tuple[bool, dict[str, Any]]
Reports = Callable[[], Awaitable[dict[str, dict[str, Any]]]]

# Serve replica states of a replica that is not serving yet (``ReplicaState`` values).
STARTING_STATES = ("STARTING", "UPDATING", "RECOVERING")
# How often the verdict is worked out while someone asks for it.
REFRESH_PERIOD_S = 1.0
# One refresh that takes longer than this counts as "cannot serve".
REFRESH_TIMEOUT_S = 5.0
# A verdict older than this (the refresher is stuck) is answered as unavailable.
MAX_AGE_S = 10.0
# The refresher stops after this long without a call; the next call starts it again.
IDLE_STOP_S = 60.0
# Serve's own view of the replicas is read again at least this often (see EngineStatesCache).
SERVE_STATUS_PERIOD_S = 10.0


def unavailable() -> Verdict:
    return False, {"status": "unavailable"}


def _enum_value(x: Any) -> str:
    """A Serve status enum's value ("RUNNING"); ``str()`` of one is "ReplicaState.RUNNING"."""
    return str(getattr(x, "value", x))


def health_verdict(
    states: dict[str, int], reports: dict[str, dict[str, Any]], deployment_status: str | None
) -> Verdict:
    """Whether every engine replica can serve, and the body of ``/health``: ``states`` counts
    the Engine deployment's replicas by Serve state, ``reports`` are the replicas' own latest
    reports. A replica still starting cannot serve yet; answering 200 then would let a client's
    first burst land on the replicas that happen to be up, where it stays."""
    running = states.get("RUNNING", 0)
    healthy = [rid for rid, r in reports.items() if r.get("healthy")]
    ok = (
        running > 0
        and not any(states.get(s, 0) for s in STARTING_STATES)
        and len(healthy) >= running
        and all(r.get("healthy") for r in reports.values())
        and deployment_status != "UNHEALTHY"
    )
    return ok, {
        "status": "ok" if ok else "unavailable",
        "replicas": states,
        "healthy_replicas": sorted(healthy),
    }


@dataclass(frozen=True)
class EngineStates:
    """Serve's view of the engine deployments: replicas counted by Serve state, and
    ``UNHEALTHY`` when Serve says so of one of them."""

    states: dict[str, int]
    deployment_status: str | None

    @property
    def steady(self) -> bool:
        """Every replica is running and no deployment is unhealthy: nothing about to change."""
        return (
            set(self.states) <= {"RUNNING"}
            and self.states.get("RUNNING", 0) > 0
            and self.deployment_status != "UNHEALTHY"
        )


def read_engine_states() -> EngineStates:
    """Blocking: ``serve.status()`` for this replica's application."""
    status = serve.status()
    app_status = status.applications.get(serve.get_replica_context().app_name)
    engine_status = app_status.deployments.get("Engine") if app_status else None
    states: dict[str, int] = {}
    deployment_status = _enum_value(engine_status.status) if engine_status else None
    # Under prefill/decode disaggregation the Prefill deployment's replicas are engine
    # replicas too (they report to the same registry).
    prefill_status = app_status.deployments.get("Prefill") if app_status else None
    for deployment in (engine_status, prefill_status):
        if deployment is None:
            continue
        for k, n in deployment.replica_states.items():
            states[_enum_value(k)] = states.get(_enum_value(k), 0) + n
        if _enum_value(deployment.status) == "UNHEALTHY":
            deployment_status = "UNHEALTHY"
    return EngineStates(states, deployment_status)


class EngineStatesCache:
    """Serve's view for the verdict, read again only when it may have changed.

    ``serve.status()`` is the costly part of a refresh: it rebuilds every deployment's config,
    and each one cloudpickles its request router class by value, walking every loaded module
    (docs/benchmarks.md has its cost), every second while anything probes ``/health``. Invariant: the cached view is used only while it was steady when read (every
    replica running, none unhealthy), the replicas that report are the same ones as then (none
    started serving, stopped or died since), and it is younger than ``period_s``; otherwise the
    next refresh reads it again."""

    def __init__(
        self,
        read: Callable[[], EngineStates] = read_engine_states,
        *,
        period_s: float = SERVE_STATUS_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.read = read
        self.period_s = period_s
        self.clock = clock
        self._view: EngineStates | None = None
        self._reporting: frozenset[str] = frozenset()
        self._at = -math.inf

    async def get(self, reporting: frozenset[str]) -> EngineStates:
        view = self._view
        if (
            view is None
            or not view.steady
            or reporting != self._reporting
            or self.clock() - self._at > self.period_s
        ):
            view = await asyncio.to_thread(self.read)
            self._view, self._reporting, self._at = view, reporting, self.clock()
        return view


async def cluster_verdict(reports: Reports, engine_states: EngineStatesCache) -> Verdict:
    """The verdict from the replicas' reports (an actor call) and Serve's view of the engine
    deployments (a controller call, when the cache says it may have changed)."""
    replica_reports = await reports()
    view = await engine_states.get(frozenset(replica_reports))
    return health_verdict(view.states, replica_reports, view.deployment_status)


class CachedVerdict:
    """A verdict refreshed in the background by one task, read by every call.

    Invariants: at most one refresh runs at a time (a single refresher task); ``get`` makes no
    call of its own: it returns the cached verdict, or, when the refresher has just (re)started
    and not finished its first refresh, waits for that one refresh (shared by every caller, at
    most ``first_wait_s``). A verdict older than ``max_age_s``, and a refresh that fails or
    overruns ``timeout_s``, answer unavailable. The refresher starts on the first call (it needs
    the running event loop, which a Serve constructor does not have) and stops after
    ``idle_stop_s`` without one, so a replica nobody probes pays nothing.
    """

    def __init__(
        self,
        compute: Callable[[], Awaitable[Verdict]],
        *,
        period_s: float = REFRESH_PERIOD_S,
        timeout_s: float = REFRESH_TIMEOUT_S,
        max_age_s: float = MAX_AGE_S,
        first_wait_s: float = REFRESH_TIMEOUT_S,
        idle_stop_s: float = IDLE_STOP_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.compute = compute
        self.period_s = period_s
        self.timeout_s = timeout_s
        self.max_age_s = max_age_s
        self.first_wait_s = first_wait_s
        self.idle_stop_s = idle_stop_s
        self.clock = clock
        self.refreshes = 0
        self._verdict: Verdict | None = None
        self._at = -math.inf
        self._asked_at = -math.inf
        self._task: asyncio.Task[None] | None = None
        # Resolved when the running refresher's first refresh has finished.
        self._first: asyncio.Future[None] | None = None

    async def get(self) -> Verdict:
        self._asked_at = self.clock()
        if self._task is None or self._task.done():
            self._start()
        first = self._first
        if first is not None and not first.done():
            await asyncio.wait([first], timeout=self.first_wait_s)
        if self._verdict is None or self.clock() - self._at > self.max_age_s:
            return unavailable()
        return self._verdict

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._first = first = loop.create_future()
        # A fresh context: the refresher's calls must not belong to the request that started it
        # (Ray cancels a request's calls when its client goes away).
        self._task = loop.create_task(self._run(first), context=contextvars.Context())

    async def _run(self, first: asyncio.Future[None]) -> None:
        try:
            while True:
                await self._refresh()
                if not first.done():
                    first.set_result(None)
                if self.clock() - self._asked_at > self.idle_stop_s:
                    return
                await asyncio.sleep(self.period_s)
        finally:
            if not first.done():
                first.set_result(None)

    async def _refresh(self) -> None:
        self.refreshes += 1
        try:
            verdict = await asyncio.wait_for(self.compute(), self.timeout_s)
        except Exception as e:  # noqa: BLE001 - any failure means "cannot serve"
            logger.warning("health refresh failed: %r", e)
            verdict = unavailable()
        self._verdict, self._at = verdict, self.clock()
