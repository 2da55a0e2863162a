"""The inter-token SLO of a handed-off request: which decode replicas keep it with one more stream.

Under prefill/decode disaggregation a request handed to the decode side carries ``tbt_slo_ms``
(``deployments.config.DisaggregationArgs``). The policy ranks the decode replicas as for any
request (where the KV is, then load); ``prefer_within_slo`` then moves the replicas predicted
to keep the SLO ahead of the others, each group in the policy's order. When none keeps it the
ranking is unchanged: the request goes to the best replica anyway and is counted as a miss.

The prediction (``predicted_step_s``): a replica reports ``decode_step_s``, its recent time
between consecutive steps that carry decode rows (the time per output token its streams get
now), measured with ``num_running`` sequences. One more stream is priced as if every stream
cost the same share of a step::

    decode_step_s * (streams + 1) / num_running,   streams = max(estimated load, num_running)

which bounds the real cost from above, since part of a step's time does not grow with its rows.
``streams`` counts the requests this router sent since the report too. A replica with no
figure (idle, or not reported yet) is taken to keep the SLO: it has no stream to slow down.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Mapping

from router.state import ReplicaView

Ranks = list[list[str]]


def predicted_step_s(view: ReplicaView | None) -> float | None:
    """Seconds per decode step on the replica with one more stream; None when it reports none."""
    if view is None or view.decode_step_s is None or view.num_running <= 0:
        return None
    streams = max(view.estimated_load, view.num_running)
    return view.decode_step_s * (streams + 1) / view.num_running


def within_slo(view: ReplicaView | None, slo_ms: float) -> bool:
    predicted = predicted_step_s(view)
    return predicted is None or predicted * 1000.0 <= slo_ms


def prefer_within_slo(
    ranks: Ranks, views: Mapping[str, ReplicaView], slo_ms: float
) -> tuple[Ranks, bool]:
    """``ranks`` with the ranks whose replicas all keep ``slo_ms`` first, the others after, each
    in their order; and whether the first choice keeps it (False: no replica does)."""
    keep = [all(within_slo(views.get(r), slo_ms) for r in rank) for rank in ranks]
    ordered = [r for r, k in zip(ranks, keep, strict=True) if k] + [
        r for r, k in zip(ranks, keep, strict=True) if not k
    ]
    return ordered, any(keep)


class SloVerdicts:
    """Whether each recently routed request's first choice kept its SLO, by request id.

    Serve builds the request router inside the ingress's process but gives it no handle on the
    ingress's metrics: the router records its verdict here and the ingress takes it when the
    request's first item arrives. The latest ranking of a request wins (Serve ranks again when
    its first choice is full). Bounded: the oldest verdicts of requests never taken (cancelled
    before their first item) are dropped. Locked: Serve may run its routers on a loop thread of
    their own."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._met: collections.OrderedDict[str, bool] = collections.OrderedDict()
        self._lock = threading.Lock()

    def record(self, request_id: str, met: bool) -> None:
        with self._lock:
            self._met.pop(request_id, None)
            self._met[request_id] = met
            while len(self._met) > self.capacity:
                self._met.popitem(last=False)

    def take(self, request_id: str) -> bool | None:
        """The request's verdict (None: never ranked with an SLO here), forgotten."""
        with self._lock:
            return self._met.pop(request_id, None)


# One per process: the ingress's and its request routers'.
VERDICTS = SloVerdicts()
