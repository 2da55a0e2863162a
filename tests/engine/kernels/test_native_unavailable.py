"""Without native kernels the engine still runs, and says so: a WARNING naming the reason and a
metric labelled with it (a deliberate switch-off is only INFO)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from deployments.metrics import ReplicaMetrics
from engine.kernels import native
from tests.deployments.support import parse_metrics, total


@pytest.fixture
def fresh_load() -> Iterator[None]:
    native.load.cache_clear()
    yield
    native.load.cache_clear()


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == native.__name__]


def test_no_compiler_is_a_warning(
    fresh_load: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog
) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, no gcc
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert native.load() is None
    assert native.unavailable_reason() == "no_compiler"
    (record,) = _records(caplog)
    assert record.levelno == logging.WARNING
    assert "no C compiler" in record.getMessage() and "PyTorch path" in record.getMessage()


def test_failed_build_is_a_warning(
    fresh_load: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog
) -> None:
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert not native.available()
    assert native.unavailable_reason() == "build_failed"
    assert [r.levelno for r in _records(caplog)] == [logging.WARNING]


def test_switched_off_is_only_info(
    fresh_load: None, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    with caplog.at_level(logging.INFO, logger=native.__name__):
        assert native.load() is None
    assert native.unavailable_reason() == "disabled"
    assert [r.levelno for r in _records(caplog)] == [logging.INFO]


def test_loaded_kernels_have_no_reason(fresh_load: None) -> None:
    # This machine has a C compiler (the test suite's kernels need one); the shared cache's
    # library is loaded, not rebuilt.
    assert native.load() is not None
    assert native.unavailable_reason() is None


@pytest.mark.parametrize(("reason", "value"), [(None, 1.0), ("no_compiler", 0.0)])
def test_metric_carries_the_reason(reason: str | None, value: float) -> None:
    metrics = ReplicaMetrics("r", "m")
    metrics.set_native_kernels(reason)
    m = parse_metrics(generate_latest(metrics.registry).decode())
    name = "prefixserve_native_kernels_available"
    assert total(m, name, replica="r", reason=reason or "") == value
    assert len([k for k in m if k[0] == name]) == 1
