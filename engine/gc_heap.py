"""Keep the cyclic garbage collector off the start-up heap of a long-running engine process.

Once a replica has loaded its model, tokenizer and frameworks (Ray, Serve, FastAPI, torch), a
few hundred thousand Python objects live as long as the process. CPython's full (generation 2)
collection walks every one of them while holding the GIL, so each full collection stalls the
engine thread between two ops and the HTTP loop alike, for a time that grows with that heap
(docs/performance.md, "Garbage collection"). :func:`freeze_startup_heap` collects once and moves
every surviving object into the permanent generation (``gc.freeze``): later collections walk
only what was allocated after it. Reference counting still frees frozen objects that become
unreachable; only cycles among them are never reclaimed, which is why it runs after start-up,
when what exists is meant to stay.
"""

from __future__ import annotations

import gc
import logging

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now; returns how many are frozen in all."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("garbage collector: %d start-up objects frozen", frozen)
    return frozen
