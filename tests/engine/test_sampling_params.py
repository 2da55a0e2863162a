"""SamplingParams validation: every bad value raises a ValueError that names its field."""

from __future__ import annotations

import pytest

from engine.sampling_params import MAX_LOGPROBS, SamplingParams


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("min_tokens", -1),
        ("temperature", -0.1),
        ("temperature", 101.0),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_k", 2.5),
        ("top_k", -2),
        ("seed", "seven"),
        ("logprobs", -1),
        ("logprobs", MAX_LOGPROBS + 1),
        ("stop", [""]),
        ("stop", ["ok", 3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.01),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"5": 1.0}),
        ("logit_bias", {5: 101.0}),
        ("logit_bias", {5: "high"}),
        ("allowed_token_ids", []),
        ("allowed_token_ids", [3, -1]),
        ("allowed_token_ids", [2.5]),
        ("allowed_token_ids", 7),
    ],
)
def test_bad_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**{field: value})


def test_min_tokens_may_not_exceed_max_tokens():
    with pytest.raises(ValueError, match="^min_tokens:"):
        SamplingParams(max_tokens=3, min_tokens=4)
    assert SamplingParams(max_tokens=3, min_tokens=3).min_tokens == 3


def test_stop_is_normalised_to_a_stop_set():
    assert list(SamplingParams(stop="###").stop_strings) == ["###"]
    assert list(SamplingParams(stop=("a", "b")).stop_strings) == ["a", "b"]
    assert list(SamplingParams().stop_strings) == []
    assert SamplingParams(stop_token_ids=None).stop_token_ids == frozenset()  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=[3, 1, 3]).stop_token_ids == frozenset({1, 3})


@pytest.mark.parametrize("seed", [2**64, 2**70, -(2**63) - 1, -(2**80)])
def test_seed_must_fit_the_generator(seed):
    """A seed beyond what torch.Generator takes fails here, naming the field, not in native code
    with "Overflow when unpacking long long"."""
    with pytest.raises(ValueError, match=r"^seed: must be an integer in \["):
        SamplingParams(seed=seed)
    with pytest.raises(ValueError, match="^seed:"):
        SamplingParams(seed=1).with_seed(seed)


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**63 - 1, 2**64 - 1])
def test_every_accepted_seed_seeds_a_generator(seed):
    import torch

    params = SamplingParams(seed=seed)
    torch.Generator().manual_seed(params.seed)


def test_greedy_and_edges():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.7).greedy
    params = SamplingParams(top_p=1.0, top_k=-1, logprobs=MAX_LOGPROBS, seed=0, temperature=100)
    assert params.top_p == 1.0 and params.logprobs == MAX_LOGPROBS


def test_adjusts_logits_only_when_a_penalty_or_bias_is_set():
    assert not SamplingParams().adjusts_logits
    assert not SamplingParams(min_p=0.5, top_k=3).adjusts_logits  # filters, not adjustments
    assert not SamplingParams(logit_bias=None).adjusts_logits  # type: ignore[arg-type]
    for change in (
        {"presence_penalty": -0.5},
        {"frequency_penalty": 2.0},
        {"repetition_penalty": 1.1},
        {"logit_bias": {3: -100}},
    ):
        assert SamplingParams(**change).adjusts_logits, change


def test_logit_bias_arrays_are_built_once_and_never_pickled():
    import pickle

    params = SamplingParams(logit_bias={7: 1.5, 3: -2})
    tokens, values = params.logit_bias_arrays()
    assert tokens.tolist() == [7, 3] and values.tolist() == [1.5, -2.0]
    assert params.logit_bias_arrays()[0] is tokens
    restored = pickle.loads(pickle.dumps(params))
    assert restored == params and "_logit_bias_arrays" not in restored.__dict__
    assert restored.logit_bias_arrays()[0].tolist() == [7, 3]
