"""kernel_cache: a library is loaded only when this user built it from these sources."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
from pathlib import Path

import pytest

from engine.kernels import kernel_cache, native

CC = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="needs a C compiler")


@pytest.fixture
def source(tmp_path: Path) -> Path:
    src = tmp_path / "src" / "answer.c"
    src.parent.mkdir()
    src.write_text("int answer(void) { return 42; }\n")
    return src


def cached(source: Path, cache: Path) -> Path:
    assert CC is not None
    return kernel_cache.cached_library(
        [source], [], CC, ["-O1", "-fPIC"], ["-shared"], "test-cpu", cache
    )


def answer(library: Path) -> int:
    return ctypes.CDLL(str(library)).answer()


def test_builds_once_into_a_private_directory(source: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    lib = cached(source, cache)
    assert lib.parent == cache and answer(lib) == 42
    assert cache.stat().st_mode & 0o777 == 0o700
    assert kernel_cache.verified(lib)
    mtime = lib.stat().st_mtime_ns
    assert cached(source, cache) == lib and lib.stat().st_mtime_ns == mtime  # not rebuilt


def test_changed_sources_get_a_new_library(source: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = cached(source, cache)
    source.write_text("int answer(void) { return 7; }\n")
    second = cached(source, cache)
    assert second != first and answer(second) == 7


@pytest.mark.parametrize("tamper", ["replace", "no_digest", "planted"])
def test_a_library_that_does_not_match_its_digest_is_rebuilt(
    source: Path, tmp_path: Path, tamper: str
) -> None:
    cache = tmp_path / "cache"
    lib = cached(source, cache)
    other = tmp_path / "other.c"
    other.write_text("int answer(void) { return 666; }\n")
    evil = kernel_cache.build([other], CC or "cc", ["-fPIC"], ["-shared"], tmp_path / "evil.so")
    sidecar = lib.with_name(lib.name + ".sha256")
    if tamper == "replace":  # bytes swapped, digest left as it was
        shutil.copyfile(evil, lib)
    elif tamper == "no_digest":
        sidecar.unlink()
    else:  # someone else's library and a digest for it
        shutil.copyfile(evil, lib)
        sidecar.write_text(kernel_cache._digest(lib))
        os.chmod(lib, 0o666)  # writable by others: never trusted
    assert not kernel_cache.verified(lib)
    rebuilt = cached(source, cache)
    assert rebuilt == lib and kernel_cache.verified(lib) and answer(lib) == 42


@pytest.mark.parametrize("unsafe", ["world_writable", "symlink"])
def test_an_unsafe_cache_directory_is_not_used(
    source: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, unsafe: str
) -> None:
    cache = tmp_path / "cache"
    if unsafe == "world_writable":
        cache.mkdir()
        os.chmod(cache, 0o777)
    else:
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        cache.symlink_to(tmp_path / "elsewhere")
    with caplog.at_level(logging.WARNING):
        lib = cached(source, cache)
    assert answer(lib) == 42
    assert lib.parent.resolve() != cache.resolve()
    assert not list(cache.iterdir())
    assert "not used" in caplog.text


def test_native_load_rebuilds_a_tampered_kernel_library(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    native.load.cache_clear()
    try:
        assert native.load() is not None
        (lib,) = (tmp_path / "kernels").glob("*.so")
        # A new file in its place (writing into it would corrupt the copy this process mapped).
        planted = tmp_path / "planted"
        planted.write_bytes(b"\x7fELF not a library")
        os.replace(planted, lib)
        native.load.cache_clear()
        assert native.load() is not None  # rebuilt, not loaded as found
        assert kernel_cache.verified(lib)
    finally:
        native.load.cache_clear()
