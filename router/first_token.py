"""First tokens the ingress relays, for the request routers of its process.

In the routed layout the ingress relays every engine stream, so it sees when a request's first
item arrives: its prefill on the chosen replica is over, and its prompt no longer stands
between the replica and the next request (``RoutingPolicy.on_request_first_token``). Serve
builds the request router inside the ingress's process but gives the ingress no handle on it,
so they meet here: a router ``watch``es each engine request id it ranks, with its own inbox; the
ingress reports ``arrived`` on a request's first item, which puts ``(request id, time)`` in the
inbox of the router that watches it (and in no other: one process may hold several routers, one
per deployment handle); the router drains its inbox on its own loop before its next ranking.
Bounded: the oldest watches of requests never reported (failed or cancelled before their first
item) are dropped. Locked: Serve may run its routers on a loop thread of their own.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable


class FirstTokens:
    def __init__(self, capacity: int = 65_536) -> None:
        self.capacity = capacity
        self._inbox: collections.OrderedDict[str, Callable[[str, float], None]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def watch(self, request_id: str, deliver: Callable[[str, float], None]) -> None:
        """Report ``request_id``'s first item to ``deliver(request_id, time)`` (which must be
        safe to call from any thread, e.g. a ``deque.append``); a later watch replaces it."""
        with self._lock:
            self._inbox.pop(request_id, None)
            self._inbox[request_id] = deliver
            while len(self._inbox) > self.capacity:
                self._inbox.popitem(last=False)

    def unwatch(self, request_id: str) -> None:
        with self._lock:
            self._inbox.pop(request_id, None)

    def arrived(self, request_id: str, now: float) -> bool:
        """``request_id``'s first item arrived at ``now`` (``time.time()``); False if no router
        watches it (another layout, or a policy that does not listen)."""
        with self._lock:
            deliver = self._inbox.pop(request_id, None)
        if deliver is None:
            return False
        deliver(request_id, now)
        return True


# One per process: the ingress's and its request routers'.
FIRST_TOKENS = FirstTokens()
