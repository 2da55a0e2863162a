"""Where the compiled kernel library is cached, and when a file there may be loaded.

Loading a shared library runs its code, so a library is loaded from the cache only if this user
built it from the current sources:

* The cache directory belongs to the user and nobody else may write to it: it is created with
  mode 0700, and one that is a symlink, owned by another user, or writable by group or others is
  not used (the library is then built into a fresh private directory for this process alone).
* The library's name is a digest of its sources, compiler flags, compiler and CPU
  (``library_key``): changed sources or flags get a new name, never a stale library.
* Each library has a sidecar ``<name>.sha256`` with the digest of its bytes, written by the build.
  A library whose sidecar is missing or does not match (a partial write, a file planted or
  replaced) is rebuilt before anything loads it.

Builds are atomic: objects and the library are written under temporary names in the cache
directory and renamed into place, so concurrent processes building the same key converge (at
worst one rebuilds once more).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 120


class UnsafeCacheError(RuntimeError):
    """The cache directory could be written by someone else."""


def library_key(sources: Sequence[Path], compiler: str, flags: Sequence[str], cpu: str) -> str:
    """The digest that names a library: every source byte, the compiler, its flags, the CPU."""
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.read_bytes())
    digest.update(" ".join([compiler, *flags]).encode())
    digest.update(cpu.encode())
    return digest.hexdigest()[:16]


def private_dir(path: Path) -> Path:
    """``path``, created 0700 if missing; raises UnsafeCacheError if another user could write
    into it (so could plant a library there)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheError(f"{path} is not a plain directory")
    if st.st_uid != os.getuid():
        raise UnsafeCacheError(f"{path} belongs to uid {st.st_uid}, not {os.getuid()}")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheError(f"{path} is writable by group or others")
    return path


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _sidecar(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def verified(library: Path) -> bool:
    """Whether ``library`` is a regular file of this user, writable by no one else, whose bytes
    match the digest its build recorded."""
    try:
        st = library.lstat()
        recorded = _sidecar(library).read_text().strip()
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        return False
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return False
    return _digest(library) == recorded


def build(
    sources: Sequence[Path],
    compiler: str,
    cflags: Sequence[str],
    ldflags: Sequence[str],
    out: Path,
) -> Path:
    """Compile ``sources`` (C files) into the shared library ``out`` and record its digest.
    Raises subprocess.SubprocessError or OSError when the build fails."""
    fd, tmp = tempfile.mkstemp(prefix=f".{out.stem}-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(dir=out.parent) as objdir:
            objects = [str(Path(objdir) / f"{src.stem}.o") for src in sources]
            for src, obj in zip(sources, objects, strict=True):
                subprocess.run(
                    [compiler, *cflags, "-c", str(src), "-o", obj],
                    check=True,
                    capture_output=True,
                    timeout=BUILD_TIMEOUT_S,
                )
            subprocess.run(
                [compiler, *ldflags, *objects, "-o", tmp, "-lm"],
                check=True,
                capture_output=True,
                timeout=BUILD_TIMEOUT_S,
            )
        os.chmod(tmp, 0o700)
        # The digest first: a reader that sees the new library finds its digest already there.
        _write_atomic(_sidecar(out), _digest(Path(tmp)) + "\n")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def cached_library(
    sources: Sequence[Path],
    headers: Sequence[Path],
    compiler: str,
    cflags: Sequence[str],
    ldflags: Sequence[str],
    cpu: str,
    cache: Path,
) -> Path:
    """The library for these sources and flags, from ``cache`` when a verified copy is there,
    else built (into a private temporary directory when ``cache`` is not safe to use)."""
    key = library_key([*sources, *headers], compiler, [*cflags, *ldflags], cpu)
    try:
        directory = private_dir(cache)
    except (UnsafeCacheError, OSError) as e:
        logger.warning("kernel cache %s not used (%s); building for this process only", cache, e)
        directory = Path(tempfile.mkdtemp(prefix="prefixserve-kernels-"))
    out = directory / f"prefixserve_kernels-{key}.so"
    if verified(out):
        return out
    return build(sources, compiler, cflags, ldflags, out)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
