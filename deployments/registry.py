"""The replica registry: one small actor per application that every engine replica reports to.

Each engine replica reports, about once a second, its health and a metrics snapshot. The ingress
reads the registry to serve ``/metrics`` (merged over replicas) and to find which replicas are
alive. A replica that stops reporting for ``stale_after_s`` is dropped: it died or was replaced.
"""

from __future__ import annotations

import time
from typing import Any

import ray


@ray.remote(num_cpus=0)
class ReplicaRegistry:
    def __init__(self, stale_after_s: float = 10.0) -> None:
        self.stale_after_s = stale_after_s
        self._reports: dict[str, dict[str, Any]] = {}

    def report(self, replica_id: str, report: dict[str, Any]) -> None:
        report["received_at"] = time.time()
        self._reports[replica_id] = report

    def forget(self, replica_id: str) -> None:
        self._reports.pop(replica_id, None)

    def live(self) -> dict[str, dict[str, Any]]:
        now = time.time()
        for rid in [
            r for r, rep in self._reports.items() if now - rep["received_at"] > self.stale_after_s
        ]:
            del self._reports[rid]
        return dict(self._reports)
