"""What the host CPU is, as Linux reports it in /proc/cpuinfo.

Read once per process: the answers decide kernel paths (bf16 or float32, oneDNN or MKL) and
cannot change while it runs. Where /proc/cpuinfo is unreadable (not Linux), every answer is
empty, and callers fall back to the choices measured on Intel.
"""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def _fields() -> dict[str, str]:
    """The first processor's ``key: value`` lines (every core of one host reports the same)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``avx2``, ``avx512_bf16``, ``amx_bf16``...)."""
    return frozenset(_fields().get("flags", "").split())


def cpu_vendor() -> str:
    """``GenuineIntel``, ``AuthenticAMD``, ... or "" where unknown."""
    return _fields().get("vendor_id", "")


def cpu_model_name() -> str:
    """``AMD EPYC ...``, ``Intel(R) Xeon(R) ...``, or "" where unknown."""
    return _fields().get("model name", "")


def cpu_has_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX); without either, torch's
    bf16 matmuls are emulated."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})
