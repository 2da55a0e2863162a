"""Structured outputs in the engine: sampled output always matches its constraint (checked with
jsonschema and re, not with the grammar library that enforced it), other rows of the batch are
untouched, prefix caching still hits, and every block comes back."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.structured_output import StructuredOutputs

PROMPT = "Reply with JSON describing a city:"


@pytest.fixture(scope="module")
def llm(tiny_llama_with_tokenizer) -> LLM:
    return LLM(model=str(tiny_llama_with_tokenizer), dtype="float32", num_kv_blocks=256)


@pytest.fixture(autouse=True)
def engine_is_left_clean(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        assert not engine.has_unfinished_requests()
        assert engine.kv.pool.num_free_blocks == engine.num_blocks


# A bounded family of schemas: every value has a bounded size, so a document always completes
# well within max_tokens and any failure to validate is the constraint's fault.
names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)
leaf = st.one_of(
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-1000, 1000),
        st.integers(0, 1000),
    ),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.just({"type": "boolean"}),
    st.builds(lambda xs: {"enum": xs}, st.lists(names, min_size=1, max_size=3, unique=True)),
    st.just({"type": "null"}),
)


def _object(props: dict) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": sorted(props),
        "additionalProperties": False,
    }


schemas = st.recursive(
    leaf,
    lambda inner: st.one_of(
        st.builds(
            lambda items, n: {"type": "array", "items": items, "maxItems": n},
            inner,
            st.integers(0, 3),
        ),
        st.dictionaries(names, inner, min_size=1, max_size=3).map(_object),
    ),
    max_leaves=5,
).map(lambda s: s if s.get("type") == "object" else _object({"value": s}))


@settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=schemas, seed=st.integers(0, 2**31))
def test_sampled_json_always_validates(llm: LLM, schema: dict, seed: int) -> None:
    spec = StructuredOutputs(json=schema)
    params = [
        SamplingParams(temperature=1.0, seed=seed + k, max_tokens=400, structured_outputs=spec)
        for k in range(2)
    ]
    for out in llm.generate([PROMPT] * 2, params):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_regex_and_choice(llm: LLM) -> None:
    cases = [
        (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (
            StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,4}"),
            lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t),
        ),
        (
            StructuredOutputs(choice=["red", "green", "blue"]),
            lambda t: t in {"red", "green", "blue"},
        ),
    ]
    params = [
        SamplingParams(temperature=1.0, seed=7, max_tokens=200, structured_outputs=spec)
        for spec, _ in cases
    ]
    for out, (_, ok) in zip(llm.generate([PROMPT] * len(cases), params), cases, strict=True):
        assert out.finish_reason == "stop"
        assert ok(out.text), out.text


def test_unconstrained_rows_are_unchanged(llm: LLM) -> None:
    """A row without a grammar samples what it would sample alone, greedy and seeded."""
    free = [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, logprobs=2),
    ]
    alone = [o.token_ids for o in llm.generate([PROMPT] * 2, free)]
    spec = StructuredOutputs(choice=["yes", "no"])
    mixed = llm.generate(
        [PROMPT] * 4,
        [free[0], SamplingParams(temperature=0.0, structured_outputs=spec), free[1]]
        + [SamplingParams(temperature=1.0, seed=1, logprobs=1, structured_outputs=spec)],
    )
    assert [mixed[0].token_ids, mixed[2].token_ids] == alone
    assert mixed[1].text in ("yes", "no") and mixed[3].text in ("yes", "no")


def test_logprobs_come_from_the_unmasked_distribution(llm: LLM) -> None:
    """The constrained row reports the model's own logprobs: its top alternatives include
    tokens the grammar forbade."""
    spec = StructuredOutputs(choice=["yes"])
    [out] = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, logprobs=5, structured_outputs=spec)
    )
    tok = llm.get_tokenizer()
    first = out.logprobs[0]
    assert tok.decode([first.token_id]) in ("y", "yes")
    assert any(not "yes".startswith(tok.decode([t])) for t, _ in first.top)


def test_prefix_cache_still_hits(llm: LLM) -> None:
    prompt = PROMPT + " " + "Paris, London, Rome. " * 8
    spec = StructuredOutputs(regex=r"[a-z]{1,8}")
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=20, structured_outputs=spec)
    llm.generate([prompt], params)
    [second] = llm.generate([prompt], params)
    assert second.num_cached_tokens > 0
    assert re.fullmatch(r"[a-z]{1,8}", second.text)


def test_exactly_one_constraint_and_bad_ones_fail() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    for bad in (
        StructuredOutputs(json={"type": "strin"}),
        StructuredOutputs(json="{not json"),
        StructuredOutputs(regex="a(b"),
        StructuredOutputs(choice=[]),
    ):
        with pytest.raises(ValueError):
            bad.check()


def test_min_tokens_holds_back_an_optional_end(llm: LLM) -> None:
    """Where the grammar may end or go on, min_tokens keeps it going; a complete grammar ends
    the output (nothing else is allowed) whatever min_tokens says."""
    spec = StructuredOutputs(regex=r"[a-z ]{1,60}")
    for seed in range(3):
        [out] = llm.generate(
            [PROMPT],
            SamplingParams(temperature=1.0, seed=seed, min_tokens=5, structured_outputs=spec),
        )
        assert len(out.token_ids) >= 5 and re.fullmatch(r"[a-z ]{1,60}", out.text)
    [out] = llm.generate(
        [PROMPT],
        SamplingParams(min_tokens=6, structured_outputs=StructuredOutputs(choice=["yes"])),
    )
    assert out.text == "yes" and out.finish_reason == "stop"


def test_masks_match_the_librarys_own(llm: LLM) -> None:
    """The sampler's masking agrees with llguidance's reference (numpy) on the listed rows and
    leaves the others alone."""
    import llguidance.numpy as lnp
    import numpy as np
    import torch

    from engine.structured_output import apply_token_masks

    compiler = llm.engine.grammars
    matchers = [
        compiler.matcher(StructuredOutputs(regex=r"[0-9]+")),
        compiler.matcher(StructuredOutputs(json={"type": "object"})),
    ]
    vocab = llm.engine.model_cfg.vocab_size
    logits = torch.randn(4, vocab)
    ours = logits.clone()
    apply_token_masks(ours, [1, 3], matchers)
    expected = logits.numpy().copy()
    for row, m in zip([1, 3], matchers, strict=True):
        mask = lnp.allocate_token_bitmask(1, vocab)
        lnp.fill_next_token_bitmask(m, mask, 0)
        lnp.apply_token_bitmask_inplace(expected[row : row + 1], mask)
    np.testing.assert_array_equal(ours.numpy(), expected)
    assert torch.equal(ours[[0, 2]], logits[[0, 2]])
    assert 0 < int(torch.isfinite(ours[1]).sum()) < vocab
