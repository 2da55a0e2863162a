"""Engine tests run their tiny models on one thread: at these sizes a second intra-op thread only
adds synchronisation, which on a busy 2-core machine costs 10x per step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
