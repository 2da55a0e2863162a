"""Fair share of a step among request groups.

A group is the client request that produced a set of sequences: every prompt x ``n`` choice of
one HTTP request carries the same ``Request.group_id``. A wide request's rows lengthen every
step for every other stream (on a CPU each row adds a roughly fixed cost to a decode step), so
with ``EngineConfig.max_seqs_per_group`` set and more than one group in the scheduler (running
or waiting), one step schedules at most that many sequences of a group:

* running sequences, decodes and prefill chunks alike, rotate: the group's sequences scheduled
  least recently go first, so each of ``m`` running sequences runs at least once every
  ``ceil(m / cap)`` steps;
* while a group has sequences waiting, up to ``cap - 1`` of its slots are left to admitting
  them (at least one slot always goes to its running sequences, so that they keep finishing
  and freeing blocks), so every choice of a wide request starts, not only the first few;
* a waiting sequence whose group has used its slots this step is passed over, and the requests
  behind it in the queue may be admitted instead.

A group alone is never capped: a batch job keeps the whole batch when nobody else is there.
The cap never binds when every group has at most ``cap`` sequences (``n = 1`` traffic).

Invariant: leaving a sequence out of a step only leaves it out of that step's batch. It keeps
its blocks and its progress; nothing is allocated or freed for it, and a preemption still picks
its victim among every running sequence not yet scheduled.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence

from engine.request import Request


class FairShare:
    """Per-group step slots; ``cap=None`` turns the policy off (every method then admits all)."""

    def __init__(self, cap: int | None) -> None:
        self.cap = cap
        # Requests per group in the scheduler (running or waiting); no zero entries.
        self._sizes: Counter[str] = Counter()
        # request_id -> the step it was last scheduled in (only while the request is unfinished).
        self._last_step: dict[str, int] = {}
        self._step = 0
        self._active = False
        self._skip: set[str] = set()
        self._taken: Counter[str] = Counter()

    # -- membership ------------------------------------------------------------------------------
    def on_add(self, request: Request) -> None:
        self._sizes[request.group_id] += 1

    def on_finish(self, request: Request) -> None:
        group = request.group_id
        self._sizes[group] -= 1
        if self._sizes[group] <= 0:
            del self._sizes[group]
        self._last_step.pop(request.request_id, None)

    @property
    def num_groups(self) -> int:
        return len(self._sizes)

    @property
    def contended(self) -> bool:
        """Whether the cap applies now: it is set and more than one group has requests."""
        return self.cap is not None and len(self._sizes) > 1

    # -- one step --------------------------------------------------------------------------------
    def begin_step(self, running: Sequence[Request], waiting: Iterable[Request]) -> None:
        """Choose which running sequences of each group sit this step out."""
        self._step += 1
        self._skip = set()
        self._taken = Counter()
        self._active = self.contended
        if not self._active:
            return
        cap = self.cap
        assert cap is not None
        members: dict[str, list[Request]] = defaultdict(list)
        for request in running:
            members[request.group_id].append(request)
        waiting_per_group = Counter(r.group_id for r in waiting)
        for group, requests in members.items():
            slots = cap - min(waiting_per_group[group], cap - 1)
            if len(requests) <= slots:
                continue
            # Stable: among sequences last scheduled in the same step, policy order decides.
            requests.sort(key=lambda r: self._last_step.get(r.request_id, -1))
            self._skip.update(r.request_id for r in requests[slots:])

    def runs(self, request: Request) -> bool:
        """Whether running ``request`` takes part in this step."""
        return request.request_id not in self._skip

    def admits(self, request: Request) -> bool:
        """Whether waiting ``request``'s group has a slot left in this step."""
        return not self._active or self._taken[request.group_id] < self.cap  # type: ignore[operator]

    def scheduled(self, request: Request) -> None:
        """``request`` is in this step's batch."""
        self._taken[request.group_id] += 1
        self._last_step[request.request_id] = self._step

    def num_scheduled(self, group_id: str) -> int:
        """Sequences of ``group_id`` in the step being built."""
        return self._taken[group_id]
