"""Fault injection for integration tests: stall an engine replica's engine thread on purpose.

Off unless the replica's environment names a trigger file in ``PREFIXSERVE_FAULT_STALL_FILE`` (a
test sets it through the deployment's ``runtime_env``); no route, request field or app argument
can turn it on. With it set, the engine thread blocks at the start of each step for as long as
that file exists and holds this replica's id, as a wedged kernel would: the engine's watchdog
(``engine_stall_timeout_s``) must notice, end the replica's streams with an error and take the
replica down. A replacement replica has another id, so it is not stalled by the same file.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

from engine.llm_engine import LLMEngine
from engine.outputs import RequestDelta

logger = logging.getLogger("ray.serve")

STALL_FILE_ENV = "PREFIXSERVE_FAULT_STALL_FILE"
# How often a stalled step looks at the trigger file again.
POLL_S = 0.05


def stall_requested(path: Path, replica_id: str) -> bool:
    """Whether ``path`` exists and names ``replica_id``."""
    try:
        return path.read_text().strip() == replica_id
    except OSError:
        return False


def install_stall_hook(
    engine: LLMEngine, replica_id: str, environ: Mapping[str, str] | None = None
) -> bool:
    """Make ``engine.step`` stall while the trigger file names ``replica_id``, if the
    environment enables it; returns whether it did. Call before the engine thread starts."""
    value = (os.environ if environ is None else environ).get(STALL_FILE_ENV)
    if not value:
        return False
    path = Path(value)
    step = engine.step

    def step_or_stall() -> list[RequestDelta]:
        while stall_requested(path, replica_id):
            time.sleep(POLL_S)
        return step()

    # An instance attribute shadows the method: the engine thread calls engine.step() each time.
    engine.step = step_or_stall  # type: ignore[method-assign]
    logger.warning("fault injection on: replica %s stalls while %s names it", replica_id, path)
    return True
