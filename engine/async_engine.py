"""An LLMEngine driven by one background thread, fed and drained from asyncio.

Ownership: only the engine thread touches the LLMEngine after ``start()``. Other threads talk to it
through ``_commands`` (a thread-safe queue of callables run between steps) and receive results on
per-request asyncio queues. Admission is a queue put: validation runs on the caller's thread
(``make_request`` reads only immutable engine state), and no model work ever happens on the request
path.

Results reach the event loop once per engine step (one ``call_soon_threadsafe`` carrying every
delta of the step), not once per token.

Stream items: every batch a stream yields crosses process boundaries downstream (engine replica to
ingress to HTTP proxy), and each crossing costs CPU that the engine shares. ``items_per_s``, when
set, caps the items all streams together yield per second: each stream's coalescing window widens
to ``num_streams / items_per_s`` when that exceeds the caller's own window. A lone stream still
gets every token at once; 32 streams under a cap of 100/s get about three items a second each.

CPU affinity: given ``cpus``, the engine thread restricts itself to those CPUs before its first
step (only itself: other threads of the process keep theirs). Intra-op threads that torch starts
from it later inherit the set.

OpenMP teams: the engine thread is the only thread of a serving process that runs parallel work
(torch ops, native kernels). Each thread that does becomes the master of an OpenMP team whose
workers live as long as it does, and libgomp counts the threads of every team: once they
outnumber the process's CPUs, its barriers spin about a hundred times instead of ~300,000 before
sleeping on a futex, so each of the hundreds of barriers in a step turns into a sleep and a
wake-up. Build the engine with ``build_on_own_thread`` (loading and packing a model is parallel
work) and hand tensors to other threads as numpy arrays.

Warm-up: started with ``warm_up=True``, the engine thread first runs ``engine.warmup.warm_up``
(every batch shape class once, on the thread and OpenMP team that will serve) and only then
takes commands; ``check_health`` raises ``EngineWarmingUp`` and ``is_ready`` is False until it
has finished. Requests that arrive meanwhile wait in the command queue.

Failure: if ``step()`` (or any command) raises, the loop stops for good. ``error`` is set and every
registered stream and every pending ``call`` future receive ``EngineDeadError`` in the same
critical section (under ``_lock``), and nothing registers after it, so no caller waits forever on
a dead engine. ``check_health`` then raises, which is what the serving layer reports to Serve.
``error`` is set once: the first failure is the one every caller hears about.

Stalls: a step or command that never returns (a deadlock in a kernel, a wedged device) cannot be
interrupted from Python, and would leave every stream waiting forever. With ``stall_timeout_s``
set, the engine thread stamps ``_busy_since`` whenever it starts work and again each time it
finishes a step or command, and clears it while it waits for work; once it has been busy on one
unit of work for longer than the bound, ``check_health`` raises ``EngineStalledError`` and a
watchdog thread ends the engine exactly as a failure would (``_fail_all`` from the watchdog's
thread, then ``on_death``). That is safe because no thread holds ``_lock`` across engine work:
the stalled thread cannot be holding it. If the stalled step ever returns, the loop sees
``_stop`` and leaves; what it produced goes nowhere, since every stream already has its error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.block_hash import BlockHash
from engine.llm_engine import LLMEngine
from engine.outputs import RequestDelta
from engine.sampling_params import SamplingParams
from engine.warmup import WarmupReport, warm_up

logger = logging.getLogger(__name__)

T = TypeVar("T")


def build_on_own_thread(factory: Callable[[], T]) -> T:
    """``factory()``, run on a thread that has ended when this returns, taking its OpenMP team
    with it (see the module docstring): the caller's thread starts no team of its own."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine-build") as pool:
        return pool.submit(factory).result()


class EngineDeadError(RuntimeError):
    """The engine loop stopped on an exception; every live stream ends with this error."""


class EngineWarmingUp(RuntimeError):
    """The engine thread is still warming up: alive, not yet serving."""


class EngineStalledError(EngineDeadError):
    """The engine thread spent longer than ``stall_timeout_s`` on one step or command."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    finished: bool = False


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        idle_wait_s: float = 0.05,
        items_per_s: float | None = None,
        cpus: frozenset[int] | None = None,
        stall_timeout_s: float | None = None,
        batch_wait_s: float = 0.0,
        batch_wait_max_s: float = 0.1,
    ) -> None:
        if batch_wait_s < 0 or batch_wait_max_s <= 0:
            raise ValueError(
                f"batch_wait_s must be >= 0 and batch_wait_max_s > 0, got {batch_wait_s}, "
                f"{batch_wait_max_s}"
            )
        if items_per_s is not None and items_per_s <= 0:
            raise ValueError(f"items_per_s must be positive, got {items_per_s}")
        if stall_timeout_s is not None and stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be positive, got {stall_timeout_s}")
        if cpus is not None and not cpus:
            raise ValueError("cpus: must name at least one CPU, or be None")
        self.engine = engine
        self.cpus = cpus
        self.idle_wait_s = idle_wait_s
        self.items_per_s = items_per_s
        # See ``_gather_burst``; 0: an idle engine starts on its first request at once.
        self.batch_wait_s = batch_wait_s
        self.batch_wait_max_s = batch_wait_max_s
        # None: no watchdog (a step may take as long as it takes).
        self.stall_timeout_s = stall_timeout_s
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        # Futures of ``call`` commands not yet finished; failed if the loop dies or stalls first.
        self._pending_calls: set[asyncio.Future] = set()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # Set once, under ``_lock``, when the loop dies or stalls.
        self.error: BaseException | None = None
        # Called once, after every waiter was failed, when the loop died of an exception (on the
        # engine thread) or stalled (on the watchdog's thread), never on shutdown: the owner may
        # take the process down.
        self.on_death: Callable[[BaseException], None] | None = None
        self.last_step_at = time.monotonic()
        # Written only by the engine thread: when it last started or finished a unit of work
        # (step or command); None while it waits for work. Read by the watchdog and health checks.
        self._busy_since: float | None = None
        # Set once the engine thread is ready to serve (after its warm-up, if any).
        self._ready = threading.Event()
        self._warm_up = False
        self.warmup_report: WarmupReport | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, warm_up: bool = False) -> None:
        """Start the engine thread; with ``warm_up``, it warms the engine up before serving."""
        if self._thread is None:
            self._warm_up = warm_up
            if not warm_up:
                self._ready.set()
            self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
            self._thread.start()
            if self.stall_timeout_s is not None:
                threading.Thread(target=self._watch, name="engine-watchdog", daemon=True).start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def num_streams(self) -> int:
        """Requests between ``generate`` and the end of their stream (admitted or in transit)."""
        return len(self._streams)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def is_ready(self) -> bool:
        """Alive and past its warm-up: able to serve."""
        return self._ready.is_set() and self.is_alive

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the engine is ready to serve (True), it died (raises), or ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ready.wait(0.05):
            self._check_running()
            if deadline is not None and time.monotonic() >= deadline:
                return False
        self._raise_if_dead()
        return True

    def check_health(self) -> None:
        """Raises ``EngineDeadError`` when the loop died or stopped, ``EngineStalledError`` as
        soon as the current step or command has overrun ``stall_timeout_s`` (the watchdog may
        not have woken yet), ``EngineWarmingUp`` until the warm-up has finished."""
        self._check_running()
        if not self._ready.is_set():
            raise EngineWarmingUp("engine is warming up")

    def _check_running(self) -> None:
        self._raise_if_dead()
        if self._thread is None or not self._thread.is_alive():
            raise EngineDeadError("engine loop is not running")
        stalled = self._stall()
        if stalled is not None:
            raise stalled

    @property
    def busy_for_s(self) -> float:
        """Seconds since the engine thread last started or finished a step or command, while it
        has work; 0 while it waits for work."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def _stall(self) -> EngineStalledError | None:
        if self.stall_timeout_s is None:
            return None
        busy = self.busy_for_s
        if busy <= self.stall_timeout_s:
            return None
        return EngineStalledError(
            f"engine thread stalled: no step or command finished in {busy:.1f} s "
            f"(limit {self.stall_timeout_s:g} s)"
        )

    # -- requests --------------------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        deadline_ms: float | None = None,
        coalesce_s: float = 0.0,
        cache_salt: str | None = None,
        kv_transfer: Any = None,
        group_id: str | None = None,
    ) -> AsyncIterator[list[RequestDelta]]:
        """Stream the request's deltas, in batches. Raises ValueError for invalid input before
        anything is queued; leaving the iteration early (client gone, cancellation) aborts the
        request and frees its blocks.

        The first token goes out alone and at once; after it, deltas that arrive within the
        coalescing window of the previous batch are merged into one, since every item that crosses
        a process boundary costs CPU. The window is ``coalesce_s``, or ``window_s()`` when the
        item budget makes that longer. The final delta ends a batch at once.
        """
        self._check_running()
        request = self.engine.make_request(
            request_id,
            prompt,
            params,
            priority=priority,
            deadline_ms=deadline_ms,
            cache_salt=cache_salt,
            group_id=group_id,
        )
        # For the engine's KV connector, which takes it when the request is added.
        request.kv_transfer = kv_transfer
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            # Checked again under the lock: a stream registered after the loop died would never
            # be failed by it.
            self._raise_if_dead()
            if request_id in self._streams:
                raise ValueError(f"request_id: {request_id!r} is already running")
            self._streams[request_id] = stream

        def add() -> None:
            try:
                self.engine.add_prepared_request(request)
            except Exception as e:  # noqa: BLE001 - belongs to this request only
                _post(stream.loop, stream.queue.put_nowait, e)

        self._commands.put(add)
        last_yield: float | None = None
        try:
            while True:
                batch = [await stream.queue.get()]
                if last_yield is not None and (window := max(coalesce_s, self.window_s())) > 0:
                    # Gather until the window closes, but never hold back the final delta.
                    deadline = last_yield + window
                    while not _ends(batch) and (remaining := deadline - time.monotonic()) > 0:
                        # Not asyncio.wait_for: on Python 3.11 it can swallow a cancellation
                        # that lands as the item arrives, and a stream cancelled by
                        # merge_streams would then run on to its end.
                        try:
                            async with asyncio.timeout(remaining):
                                batch.append(await stream.queue.get())
                        except TimeoutError:
                            break
                while not _ends(batch) and not stream.queue.empty():
                    batch.append(stream.queue.get_nowait())
                error = next((b for b in batch if isinstance(b, BaseException)), None)
                if error is not None:
                    raise error
                last_yield = time.monotonic()
                yield batch
                if batch[-1].finished:
                    stream.finished = True
                    return
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not stream.finished:
                self.abort(request_id)

    def window_s(self) -> float:
        """The coalescing window the item budget imposes on every stream now (0 without one)."""
        if self.items_per_s is None:
            return 0.0
        return len(self._streams) / self.items_per_s

    def abort(self, request_id: str) -> None:
        self._commands.put(lambda: self.engine.abort_request(request_id))

    def call(self, fn: Callable[[LLMEngine], Any]) -> asyncio.Future:
        """Run ``fn(engine)`` on the engine thread between steps; await the returned future."""
        self._check_running()
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def run() -> None:
            # Still pending while ``fn`` runs: if it stalls, the watchdog fails this future too.
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                _post(loop, _set_exception, fut, e)
            else:
                _post(loop, _set_result, fut, result)
            finally:
                with self._lock:
                    self._pending_calls.discard(fut)

        with self._lock:
            self._raise_if_dead()
            self._pending_calls.add(fut)
        self._commands.put(run)
        return fut

    def _raise_if_dead(self) -> None:
        if self.error is not None:
            raise _death_error(self.error) from self.error

    # -- the loop --------------------------------------------------------------------------------
    def _drain_commands(self, block: bool) -> None:
        try:
            if block:
                self._busy_since = None  # waiting for work is no stall
                cmd = self._commands.get(timeout=self.idle_wait_s)
                self._busy_since = time.monotonic()
            else:
                cmd = self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            cmd()
            self._busy_since = time.monotonic()
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _gather_burst(self) -> None:
        """Called when an idle engine has just taken work: keep taking commands while each
        arrives within ``batch_wait_s`` of the previous one, for at most ``batch_wait_max_s``,
        and only while the waiting prompts would not fill a step anyway. A prompt counts only
        the tokens a step would compute for it: not the blocks the prefix cache holds, nor
        those another waiting prompt of the burst shares (a wave behind a few new prefixes
        then starts in one step).

        Why: a forward pass cannot take requests that arrive while it runs. Without the wait, the
        first request of a burst (a client's wave of concurrent requests) runs alone and the rest
        of the burst waits for that step, which on a CPU is slowed further by the replica's event
        loop taking in the burst beside it. A request that arrives alone pays ``batch_wait_s``.
        """
        if self.batch_wait_s <= 0:
            return
        deadline = time.monotonic() + self.batch_wait_max_s
        budget = self.engine.config.max_num_batched_tokens
        counted: set[BlockHash] = set()
        seen: set[str] = set()
        work = 0
        while True:
            # Requests only arrive during the gather (an abort may remove one: its count stays).
            for request in list(self.engine.scheduler.requests.values()):
                if request.request_id not in seen:
                    seen.add(request.request_id)
                    work += self.engine.kv.new_prefill_tokens(request, counted)
            if work >= budget:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                cmd = self._commands.get(timeout=min(self.batch_wait_s, left))
            except queue.Empty:
                return
            cmd()
            self._busy_since = time.monotonic()

    def _stamp_progress(self) -> None:
        self._busy_since = time.monotonic()

    def _pin(self) -> None:
        if self.cpus is None:
            return
        try:
            # The native thread id: on Linux this restricts this thread, not the process.
            os.sched_setaffinity(threading.get_native_id(), self.cpus)
        except (AttributeError, OSError) as e:  # not Linux, or CPUs outside the cgroup's set
            logger.warning("engine thread not pinned to CPUs %s: %s", sorted(self.cpus), e)

    def _run(self) -> None:
        self._pin()
        try:
            if self._warm_up:
                # The watchdog covers the warm-up too, one step at a time.
                self._busy_since = time.monotonic()
                self.warmup_report = warm_up(self.engine, on_step=self._stamp_progress)
            self._ready.set()
            while not self._stop.is_set():
                idle = not self.engine.has_unfinished_requests()
                self._drain_commands(block=idle)
                if idle and self.engine.has_unfinished_requests():
                    self._gather_burst()
                if not self.engine.has_unfinished_requests():
                    self.last_step_at = time.monotonic()
                    continue
                deltas = self.engine.step()
                self.last_step_at = self._busy_since = time.monotonic()
                if deltas:
                    self._dispatch(deltas)
            self._fail_all(RuntimeError("engine shut down"))
        except BaseException as e:  # noqa: BLE001 - the loop must report, not vanish
            logger.exception("engine loop died")
            # Not when the watchdog ended the engine first: that was the death, and reported.
            if self._fail_all(e) and self.on_death is not None:
                self.on_death(e)

    def _watch(self) -> None:
        """The watchdog thread: ends a stalled engine (see the module docstring)."""
        assert self.stall_timeout_s is not None
        period = min(1.0, self.stall_timeout_s / 4)
        while not self._stop.wait(period):
            if self.error is not None:
                return
            stalled = self._stall()
            if stalled is None:
                continue
            logger.error("%s: failing its streams", stalled)
            # The loop leaves at once if the stalled step ever returns.
            self._stop.set()
            if self._fail_all(stalled) and self.on_death is not None:
                self.on_death(stalled)
            return

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestDelta]]] = {}
        with self._lock:
            for d in deltas:
                stream = self._streams.get(d.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, d))
        for loop, items in by_loop.items():
            _post(loop, _put_all, items)

    def _fail_all(self, cause: BaseException) -> bool:
        """End the engine with ``cause``: every registered stream and pending call gets the
        error. Runs on the engine thread (a failure, a shutdown) or the watchdog's (a stall);
        only the first call does anything, and it returns True."""
        with self._lock:
            if self.error is not None:
                return False
            self.error = cause
            streams = list(self._streams.values())
            calls = list(self._pending_calls)
            self._pending_calls.clear()
        error = _death_error(cause)
        for stream in streams:
            _post(stream.loop, stream.queue.put_nowait, error)
        for fut in calls:
            _post(fut.get_loop(), _set_exception, fut, error)
        return True


def _death_error(cause: BaseException) -> EngineDeadError:
    """What callers of a dead engine get: a stall as it was diagnosed, anything else wrapped."""
    if isinstance(cause, EngineStalledError):
        return EngineStalledError(str(cause))
    return EngineDeadError(f"engine loop died: {cause!r}")


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    """Run ``fn(*args)`` on ``loop``; a closed loop (its owner is gone) must not take the engine
    thread down with it."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _ends(batch: list[Any]) -> bool:
    last = batch[-1]
    return isinstance(last, BaseException) or last.finished


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
