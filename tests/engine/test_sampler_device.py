"""The sampler's non-CPU noise (``engine.sampler.device_noise``), run on CPU tensors: seeded
rows come from the request's own generator whatever shares the batch, the other rows from the
device generator, and sampling with it still draws from the tempered softmax."""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, device_noise
from tests.engine.test_sampler import (
    assert_samples_tempered_softmax,
    random_logits,
    req,
    seeded_alone_and_in_batches,
)


def test_seeded_rows_come_from_their_own_generator():
    probs = torch.softmax(random_logits(3), dim=-1)
    seeded = req(seed=42)
    requests = [req(), seeded, req()]
    noise = device_noise(probs, requests, torch.Generator().manual_seed(5))
    expected = torch.empty(probs.shape[1]).exponential_(generator=torch.Generator().manual_seed(42))
    torch.testing.assert_close(noise[1], expected, rtol=0, atol=0)
    # The other rows: the device generator's draw for the whole batch, in order.
    whole = torch.empty_like(probs).exponential_(generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(noise[[0, 2]], whole[[0, 2]], rtol=0, atol=0)
    assert (noise > 0).all()


def test_seeded_request_is_reproducible_regardless_of_batch(monkeypatch):
    """With device noise, as on CPU: a seeded request samples the same tokens alone and in
    batches of other requests, and the device generator's state does not matter."""
    # Each sampler's device generator at its own state.
    gens = {}

    def draw(self, probs, requests):
        return (probs / device_noise(probs, requests, gens[id(self)])).argmax(dim=-1)

    monkeypatch.setattr(Sampler, "_draw", draw)
    logits = random_logits(6, seed=5)
    alone_sampler, batch_sampler = Sampler(), Sampler()
    gens[id(alone_sampler)] = torch.Generator().manual_seed(0)
    gens[id(batch_sampler)] = torch.Generator().manual_seed(99)
    tokens_alone, tokens_batch = seeded_alone_and_in_batches(alone_sampler, batch_sampler, logits)
    assert tokens_alone == tokens_batch
    assert len(set(tokens_alone)) > 1


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_device_noise_samples_the_tempered_softmax(monkeypatch, temperature):
    gen = torch.Generator().manual_seed(3)
    monkeypatch.setattr(
        Sampler,
        "_draw",
        lambda self, probs, requests: (probs / device_noise(probs, requests, gen)).argmax(-1),
    )
    assert_samples_tempered_softmax(Sampler(), temperature)


def test_device_generator_is_seeded_from_the_engine_seed():
    a, b = Sampler(seed=11), Sampler(seed=11)
    cpu = torch.device("cpu")
    draw_a = torch.empty(8).exponential_(generator=a._device_generator(cpu))
    draw_b = torch.empty(8).exponential_(generator=b._device_generator(cpu))
    torch.testing.assert_close(draw_a, draw_b, rtol=0, atol=0)
    assert a._device_generator(cpu) is a._device_generator(cpu)
