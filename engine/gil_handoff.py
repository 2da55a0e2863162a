"""How soon a serving process's threads hand the GIL back to the engine thread.

The engine thread releases the GIL around every native op of a step (a prefill step of the
Python layer loop makes thousands of such calls; a decode step's scheduling, input building and
sampling make dozens) and must take it back after each. When another thread of the process is
running Python bytecode at that moment (the HTTP event loop rendering a chat template or
validating a large body, a worker pool thread), CPython makes the engine thread wait until that
thread is asked to drop the GIL, which happens only after ``sys.getswitchinterval()`` (5 ms by
default). Each of those thousands of returns then costs up to the whole interval: a step of a few
hundred milliseconds stretches to tens of seconds while any other thread computes in Python,
and every stream of the replica stalls with it (docs/performance.md, "The GIL hand-off").

:func:`shorten_switch_interval` lowers the interval for the whole process. Only the wait for a
thread that runs Python shortens; a thread inside native code that holds the GIL is not
interrupted by it, and threads that block on I/O drop the GIL at once either way.

Invariant: it is a process-wide setting; call it in a process that serves (an engine replica),
not in a library caller's process.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)

# Measured against 5 ms (CPython's default) and 1 ms: docs/performance.md, "The GIL hand-off".
SWITCH_INTERVAL_S = 0.0002


def shorten_switch_interval(seconds: float = SWITCH_INTERVAL_S) -> float:
    """Set the process's switch interval to ``seconds`` (never lengthening it); returns the
    interval in force afterwards."""
    if seconds <= 0:
        raise ValueError(f"seconds: must be > 0, got {seconds}")
    if seconds < sys.getswitchinterval():
        sys.setswitchinterval(seconds)
    interval = sys.getswitchinterval()
    logger.info("GIL switch interval %.2f ms", interval * 1000)
    return interval
