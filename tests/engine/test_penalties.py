"""Penalties and logit bias: exact values on hand-made logits, untouched rows left alone."""

from __future__ import annotations

import pytest
import torch

from engine.penalties import apply_penalties, distinct_tokens
from engine.request import Request
from engine.sampling_params import SamplingParams

VOCAB = 8


def req(prompt: list[int], output: list[int], **params) -> Request:
    request = Request("r", prompt, SamplingParams(**params))
    for t in output:
        request.append_output_token(t)
    return request


def test_distinct_tokens_are_counted_per_list():
    which, tokens, counts = distinct_tokens([[1, 1, 3], [], [7, 0, 7, 7]], VOCAB)
    assert list(zip(which.tolist(), tokens.tolist(), counts.tolist(), strict=True)) == [
        (0, 1, 2),
        (0, 3, 1),
        (2, 0, 1),
        (2, 7, 3),
    ]
    which, tokens, counts = distinct_tokens([], VOCAB)
    assert len(which) == len(tokens) == len(counts) == 0


def test_no_adjustment_returns_the_same_tensor():
    logits = torch.randn(2, VOCAB)
    assert apply_penalties(logits, [req([1], [2]), req([3], [], min_p=0.3)]) is logits


def test_frequency_and_presence_count_output_tokens_only():
    logits = torch.zeros(1, VOCAB)
    # Token 1 is in the prompt only, token 2 twice in the output, token 3 once.
    r = req([1, 2], [2, 3, 2], frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(logits, [r])
    assert out[0].tolist() == [0, 0, -1.25, -0.75, 0, 0, 0, 0]
    assert logits.eq(0).all(), "the input is not modified in place"


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 0.0, 4.0, 1.0, 1.0]])
    # Prompt and output tokens both count; token 5 and 7 were never seen.
    r = req([0, 1], [4, 6], repetition_penalty=2.0)
    assert apply_penalties(logits, [r])[0].tolist() == [1.0, -4.0, 2.0, -2.0, 0.0, 4.0, 0.5, 1.0]


def test_order_bias_then_repetition_then_frequency():
    logits = torch.tensor([[1.0] * VOCAB])
    r = req([5], [5], logit_bias={5: -3.0, 6: 1.0}, repetition_penalty=2.0, frequency_penalty=1.0)
    out = apply_penalties(logits, [r])[0]
    # Token 5: 1 - 3 = -2, seen: * 2 = -4, once in the output: - 1 = -5.
    assert out[5].item() == -5.0
    assert out[6].item() == 2.0  # biased, never seen
    assert out[0].item() == 1.0


def test_only_the_rows_that_ask_are_changed():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    plain, penalized, biased = (
        req([1], [1]),
        req([1], [1], presence_penalty=1.0),
        req([2], [], logit_bias={0: 5.0}),
    )
    out = apply_penalties(logits, [plain, penalized, biased])
    assert torch.equal(out[0], logits[0])
    expected = logits[1].clone()
    expected[1] -= 1.0
    assert torch.equal(out[1], expected)
    expected = logits[2].clone()
    expected[0] += 5.0
    assert torch.equal(out[2], expected)


@pytest.mark.parametrize("token", [VOCAB, VOCAB + 100])
def test_bias_beyond_the_logits_is_ignored(token):
    # The engine refuses such ids at admission; here the logits may be narrower than the vocab.
    logits = torch.zeros(1, VOCAB)
    out = apply_penalties(logits, [req([1], [], logit_bias={token: 10.0, 2: 1.0})])
    assert out[0].tolist() == [0, 0, 1.0, 0, 0, 0, 0, 0]
