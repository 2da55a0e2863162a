"""Which CPUs an engine replica's compute thread keeps to.

On a small machine the engine threads of every replica share the cores with the HTTP proxy, the
ingress and Ray's own processes. Left to the kernel's scheduler, an engine thread moves between
cores as the others come and go, and on two shared cores it made ~6% fewer tokens per CPU-second
than the same work offline; pinned, one core per replica, it matched offline, and W1 over HTTP
gained 6% on average over four paired runs (0.6% to 10%; docs/benchmarks.md).

Pinning is only safe where Ray owns the CPUs this process may run on: the node's CPU resource
equals the size of the process's affinity set (a laptop, a VM, a Kubernetes pod with exclusive
CPUs). On a shared Kubernetes node a pod sees every host CPU but may use a quota of a few, and
every pod pinning to the same first CPUs would pile onto them, so there nothing is pinned. A
replica takes the CPUs at its rank among its deployment's replicas on the node (Serve's
``local_rank``): with 1-CPU replicas, the first takes the lowest CPU, the second the next, and so
on. A replica with a fractional or missing CPU request, or whose slot would run past the CPUs
there are, is not pinned. Replicas of the Prefill deployment (prefill/decode disaggregation)
count their slots from the highest CPU down, so that they and the Engine deployment's replicas,
ranked separately by Serve, do not take the same CPUs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import ray
from ray import serve

logger = logging.getLogger("ray.serve")


def engine_cpus(
    local_rank: int,
    num_cpus: float | None,
    allowed: Iterable[int],
    node_cpus: float | None,
    from_top: bool = False,
) -> frozenset[int] | None:
    """The CPUs for the replica of rank ``local_rank`` on its node that asked for ``num_cpus``,
    given the CPUs the process may use (``allowed``) and the node's CPU resource in Ray; None
    where it should not be pinned (see the module docstring). ``from_top``: slots counted from
    the highest CPU down."""
    if num_cpus is None or num_cpus < 1 or num_cpus != int(num_cpus) or local_rank < 0:
        return None
    cpus = sorted(allowed, reverse=from_top)
    if node_cpus is None or round(node_cpus) != len(cpus):
        return None
    n = int(num_cpus)
    chosen = cpus[local_rank * n : (local_rank + 1) * n]
    return frozenset(chosen) if len(chosen) == n else None


def replica_engine_cpus(from_top: bool = False) -> frozenset[int] | None:
    """``engine_cpus`` for the calling Serve replica (None off Linux or outside a replica)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        rank = serve.get_replica_context().rank
        context = ray.get_runtime_context()
        num_cpus = context.get_assigned_resources().get("CPU")
        node_id = context.get_node_id()
        node_cpus = next(
            (n["Resources"].get("CPU") for n in ray.nodes() if n["NodeID"] == node_id), None
        )
    except Exception:  # noqa: BLE001 - placement is an optimisation, never a reason to fail
        logger.warning("could not work out this replica's CPUs; not pinning", exc_info=True)
        return None
    local_rank = getattr(rank, "local_rank", None)
    if local_rank is None:
        return None
    return engine_cpus(local_rank, num_cpus, os.sched_getaffinity(0), node_cpus, from_top)


def restore_priority() -> bool:
    """Run this process's threads at nice 0; True if they do.

    Ray starts its worker processes at nice 15 so that its own daemons stay responsive. For an
    engine replica that is the wrong way round: the engine thread and the threads that stream
    its tokens would yield the cores to any nice-0 process (a benchmark client, a sidecar) while
    requests wait. Threads created afterwards (the engine thread and its OpenMP team) inherit the
    creating thread's value. Lowering niceness needs CAP_SYS_NICE (root in a container has it;
    a non-root Kubernetes pod does not): without it the replica keeps Ray's value and says so.
    """
    ok = True
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else []:
        try:
            if os.getpriority(os.PRIO_PROCESS, int(tid)) > 0:
                os.setpriority(os.PRIO_PROCESS, int(tid), 0)
        except (PermissionError, ProcessLookupError, OSError) as e:
            ok = False
            logger.info("engine replica keeps its nice value (%s)", e)
            break
    return ok
