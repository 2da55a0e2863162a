"""Keep freed memory in the process for reuse while the engine runs on CPU (glibc malloc).

A prefill step allocates activations of several MiB per op (the ``[2048, 3072]`` bf16 output of
one MLP projection is 12 MiB). By default glibc serves blocks that large from a fresh ``mmap``
and unmaps them on free, or trims them off the top of the heap, so every step page-faults the
same memory in again: in W1's prefill steps that left oneDNN's GEMMs and the elementwise kernels
well below their speed on warm memory (docs/performance.md, item 17).
:func:`keep_freed_memory` fixes the thresholds, as the ``MALLOC_MMAP_THRESHOLD_`` family of
variables would at start-up: blocks up to 32 MiB come from the heap, and the heap returns memory
to the system only past 1 GiB free at its top. That is what preloading tcmalloc, vLLM's advice
for CPUs, buys, without a preload. A process that preloads another allocator is unaffected.
"""

from __future__ import annotations

import ctypes
import functools
import platform

# mallopt(3) parameters.
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for this parameter on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's malloc thresholds once per process; False where this is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD),
        )
    )
