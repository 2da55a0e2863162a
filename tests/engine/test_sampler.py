"""Sampler: greedy, filters, seeds, the sampled distribution, logprobs, min_tokens."""

from __future__ import annotations

import pytest
import torch

from engine.request import Request
from engine.sampler import Sampler, cdf_draw
from engine.sampling_params import SamplingParams

VOCAB = 32


def req(eos: frozenset[int] = frozenset({2}), seed: int | None = None, **params) -> Request:
    request = Request("r", [1], SamplingParams(seed=seed, **params), eos_token_ids=eos)
    if seed is not None:
        request.generator = torch.Generator().manual_seed(seed)
    return request


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = random_logits(5)
    out = Sampler()(logits, [req(temperature=0.0) for _ in range(5)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 5


@pytest.mark.parametrize(
    "params",
    [
        pytest.param({"top_k": 1}, id="top_k=1"),
        pytest.param({"top_p": 1e-6}, id="top_p tiny"),
        pytest.param({"top_k": 1, "temperature": 5.0}, id="top_k=1 hot"),
    ],
)
def test_filters_that_keep_one_token_are_greedy(params):
    logits = random_logits(64, seed=1)
    sampler = Sampler(seed=3)
    for _ in range(3):
        out = sampler(logits, [req(**params) for _ in range(64)])
        assert out.token_ids == logits.argmax(-1).tolist()


def test_greedy_and_sampled_rows_mix():
    logits = random_logits(4, seed=2)
    requests = [req(temperature=0.0), req(top_k=1), req(temperature=0.0), req(top_p=1e-6)]
    assert Sampler()(logits, requests).token_ids == logits.argmax(-1).tolist()


def test_top_k_restricts_to_the_k_best():
    logits = random_logits(200, seed=4)
    out = Sampler(seed=0)(logits, [req(top_k=3, temperature=2.0) for _ in range(200)])
    top3 = logits.topk(3, dim=-1).indices
    assert all(t in top3[i].tolist() for i, t in enumerate(out.token_ids))
    assert len(set(out.token_ids)) > 3  # rows differ, so not one fixed token


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probs 0.5, 0.3, 0.15, 0.05: top_p=0.7 keeps the first two (0.5 < 0.7 <= 0.8).
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    out = Sampler(seed=0)(logits, [req(top_p=0.7) for _ in range(2000)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).tolist()
    assert counts[2] == counts[3] == 0
    assert chi_square(counts[:2], [0.5 / 0.8, 0.3 / 0.8]) < CHI2_CRIT[1]


def seeded_alone_and_in_batches(
    alone_sampler: Sampler, batch_sampler: Sampler, logits: torch.Tensor
) -> tuple[list[int], list[int]]:
    """20 steps of a seed-42 request sampled alone by one sampler and, by the other, in batches
    of other requests at varying positions: its tokens in each."""
    alone, in_batch = req(seed=42), req(seed=42)
    others = [req(), req(temperature=0.0), req(top_k=5)]
    tokens_alone, tokens_batch = [], []
    for step in range(20):
        row = logits[step % 6 : step % 6 + 1]
        tokens_alone += alone_sampler(row, [alone]).token_ids
        batch = others[: step % 4] + [in_batch] + others[step % 4 :]
        out = batch_sampler(row.repeat(len(batch), 1), batch)
        tokens_batch.append(out.token_ids[batch.index(in_batch)])
    return tokens_alone, tokens_batch


def test_seeded_request_is_reproducible_regardless_of_batch():
    logits = random_logits(6, seed=5)
    tokens_alone, tokens_batch = seeded_alone_and_in_batches(
        Sampler(seed=0), Sampler(seed=123), logits
    )
    assert tokens_alone == tokens_batch
    assert len(set(tokens_alone)) > 1
    # Another seed draws another sequence.
    other = req(seed=43)
    assert [Sampler()(logits[s % 6 : s % 6 + 1], [other]).token_ids[0] for s in range(20)] != (
        tokens_alone
    )


# 99.9% quantiles of the chi-square distribution with 1..3 degrees of freedom.
CHI2_CRIT = {1: 10.83, 2: 13.82, 3: 16.27}


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True))


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_sampling_follows_the_softmax(temperature):
    assert_samples_tempered_softmax(Sampler(seed=7), temperature)


def assert_samples_tempered_softmax(sampler: Sampler, temperature: float) -> None:
    """4,000 draws from four tokens at ``temperature`` fit the tempered softmax (chi-square)."""
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 4000
    logits = torch.log(torch.tensor([probs])).repeat(n, 1)
    out = sampler(logits, [req(temperature=temperature) for _ in range(n)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).tolist()
    expected = torch.softmax(torch.log(torch.tensor(probs)) / temperature, -1).tolist()
    assert chi_square(counts, expected) < CHI2_CRIT[3]
    # The check has power: the untempered distribution fails it when the temperature matters.
    if temperature != 1.0:
        assert chi_square(counts, probs) > CHI2_CRIT[3]


def test_logprobs_are_those_of_the_raw_logits():
    logits = random_logits(3, seed=8)
    requests = [req(logprobs=0), req(temperature=0.3, top_k=4, logprobs=5), req()]
    out = Sampler(seed=0)(logits, requests)
    ref = torch.log_softmax(logits, -1)
    for i in (0, 1):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(ref[i, out.token_ids[i]].item(), abs=1e-5)
    assert out.logprobs[0].top == []
    top = out.logprobs[1].top
    assert [t for t, _ in top] == ref[1].topk(5).indices.tolist()
    assert [v for _, v in top] == pytest.approx(ref[1].topk(5).values.tolist(), abs=1e-5)
    assert out.logprobs[2] is None


def test_min_tokens_suppresses_eos_and_stop_tokens():
    logits = torch.zeros(3, VOCAB)
    logits[:, 2] = 10.0  # EOS is the clear favourite
    logits[:, 5] = 9.0  # then a stop token
    early = req(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    early.output_token_ids = [9]  # one token generated, min_tokens not reached
    eos_ignored = req(temperature=0.0, min_tokens=2, ignore_eos=True)
    done = req(temperature=0.0, min_tokens=1)
    done.output_token_ids = [9]
    out = Sampler()(logits, [early, eos_ignored, done])
    assert out.token_ids[0] not in (2, 5)
    assert out.token_ids[1] == 2  # ignore_eos: EOS is an ordinary token, not suppressed
    assert out.token_ids[2] == 2
    # Sampled (not greedy) requests are suppressed too.
    sampled = req(min_tokens=1)
    tokens = Sampler()(logits.repeat(100, 1)[:100], [sampled] * 100).token_ids
    assert 2 not in tokens


def test_logits_of_other_dtypes_are_accepted():
    logits = random_logits(2).to(torch.bfloat16)
    out = Sampler()(logits, [req(temperature=0.0), req(temperature=0.0)])
    assert out.token_ids == logits.float().argmax(-1).tolist()


def test_penalties_change_a_greedy_pick_and_leave_logprobs_raw():
    logits = torch.zeros(2, VOCAB)
    logits[:, 4] = 2.0
    logits[:, 6] = 1.5
    repeated = req(temperature=0.0, presence_penalty=1.0, logprobs=0)
    repeated.output_token_ids = [4]
    out = Sampler()(logits, [repeated, req(temperature=0.0)])
    assert out.token_ids == [6, 4]
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[6].item())
    # A bias alone takes the greedy fast path's place as well.
    assert Sampler()(logits[:1], [req(temperature=0.0, logit_bias={1: 3.0})]).token_ids == [1]


def test_min_p_drops_tokens_below_its_share_of_the_best():
    # probs 0.5, 0.3, 0.15, 0.05: min_p=0.5 keeps tokens with p >= 0.25, the first two.
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(2000, 1)
    out = Sampler(seed=0)(logits, [req(min_p=0.5) for _ in range(2000)])
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=4).tolist()
    assert counts[2] == counts[3] == 0
    assert chi_square(counts[:2], [0.5 / 0.8, 0.3 / 0.8]) < CHI2_CRIT[1]
    # min_p=1 keeps only the most likely token.
    assert set(Sampler(seed=1)(logits[:50], [req(min_p=1.0)] * 50).token_ids) == {0}


def test_cdf_draw_inverts_each_rows_distribution_and_skips_tokens_without_mass():
    """Row i takes the first token whose cumulative probability exceeds u[i] (times the row's
    total: filtered rows need not sum to 1); a token of probability 0 is never drawn, not even
    for a u that rounds the target up to the row's total."""
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0], [0.0, 0.0, 0.3, 0.0, 0.0, 0.0]])

    def draw(u0: float, u1: float) -> list[int]:
        return cdf_draw(probs, torch.tensor([[u0], [u1]], dtype=torch.float64)).tolist()

    assert draw(0.0, 0.0) == [1, 2]
    assert draw(0.24, 0.5) == [1, 2]
    assert draw(0.25, 0.99) == [3, 2]  # exactly at a boundary: the next token
    assert draw(0.76, 0.0) == [4, 2]
    below_one = float(
        torch.nextafter(
            torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
        )
    )
    assert draw(below_one, below_one) == [4, 2]
    # The rounding case itself: a target past the total takes the last token with mass.
    assert draw(1.0, 1.0) == [4, 2]
