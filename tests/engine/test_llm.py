"""The offline API: shapes, finish reasons, tokenizer-less models, validation of every input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.helpers import random_tokens as tokens


def greedy(max_tokens: int = 8, **options) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **options)


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(
        model=str(tiny_llama), dtype="float32", max_model_len=128, block_size=8, num_kv_blocks=64
    )


@pytest.fixture(scope="module")
def llm_tok(tiny_llama_with_tokenizer) -> LLM:
    return LLM(model=str(tiny_llama_with_tokenizer), dtype="float32", num_kv_blocks=64)


@pytest.fixture(autouse=True)
def engine_is_left_clean(request):
    """Every test leaves its engine with nothing running and every block free."""
    yield
    for name in ("llm", "llm_tok"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name).engine
            assert not engine.has_unfinished_requests()
            assert engine.kv.pool.num_free_blocks == engine.num_blocks
            engine.kv.pool.check_invariants()


def test_outputs_come_back_in_input_order(llm):
    prompts = [tokens(n, n) for n in (90, 3, 40, 1, 17)]
    outs = llm.generate(prompts, [greedy(m) for m in (2, 9, 1, 5, 3)])
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.token_ids) for o in outs] == [2, 9, 1, 5, 3]
    assert all(o.finish_reason == "length" and o.stop_reason is None for o in outs)
    assert all(o.prompt is None and o.text == "" for o in outs)
    assert len({o.request_id for o in outs}) == len(outs)
    # A batch gives each prompt what it gets alone.
    alone = llm.generate([prompts[1]], greedy(9))[0]
    assert alone.token_ids == outs[1].token_ids


def test_single_params_apply_to_every_prompt(llm):
    outs = llm.generate([tokens(4, 1), tokens(6, 2)], greedy(3))
    assert [len(o.token_ids) for o in outs] == [3, 3]
    assert llm.generate([], greedy()) == []


def test_sampling_params_list_must_match_the_prompts(llm):
    with pytest.raises(ValueError, match="^sampling_params:"):
        llm.generate([tokens(4, 1), tokens(4, 2)], [greedy()])
    with pytest.raises(ValueError, match="^priority:"):
        llm.generate([tokens(4, 1)], greedy(), priority=[0, 1])


def test_finish_on_stop_token_ids(llm):
    prompt = tokens(10, 3)
    ref = llm.generate([prompt], greedy(8, ignore_eos=True))[0].token_ids
    stop = ref[3]
    first = ref.index(stop)
    out = llm.generate([prompt], greedy(8, stop_token_ids=[stop]))[0]
    assert out.token_ids == ref[: first + 1]  # the stop token is the last one returned
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)


def test_finish_on_eos(llm, monkeypatch):
    prompt = tokens(10, 4)
    ref = llm.generate([prompt], greedy(8, ignore_eos=True))[0].token_ids
    eos = ref[2]
    monkeypatch.setattr(llm.engine, "eos_token_ids", frozenset({eos}))
    out = llm.generate([prompt], greedy(8))[0]
    assert out.token_ids == ref[: ref.index(eos) + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    # ignore_eos generates through it.
    assert llm.generate([prompt], greedy(8, ignore_eos=True))[0].token_ids == ref
    # min_tokens forbids EOS (and so changes the greedy path) until reached.
    out = llm.generate([prompt], greedy(8, min_tokens=ref.index(eos) + 2))[0]
    assert eos not in out.token_ids[: ref.index(eos) + 2]


def test_logprobs_come_with_every_token(llm):
    out = llm.generate([tokens(5, 5)], greedy(4, logprobs=2))[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token
        assert lp.top[0][0] == token  # greedy: the sampled token is the most likely
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1]
    assert llm.generate([tokens(5, 5)], greedy(2))[0].logprobs is None


def test_repeated_prompt_reports_cached_tokens(llm):
    prompt = tokens(30, 6)
    first = llm.generate([prompt], greedy(2))[0]
    again = llm.generate([prompt], greedy(2))[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 24)
    assert again.token_ids == first.token_ids


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11)
    a = llm.generate([tokens(5, 7)], params)[0].token_ids
    b = llm.generate([tokens(9, 8), tokens(5, 7)], [SamplingParams(max_tokens=6), params])[1]
    assert a == b.token_ids


def test_string_prompts_need_a_tokenizer(llm):
    assert llm.get_tokenizer() is None
    with pytest.raises(ValueError, match="^prompt:.*tokenizer"):
        llm.generate("hello", greedy())
    with pytest.raises(ValueError, match="^messages:"):
        llm.chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "prompt, match",
    [
        pytest.param([], "^prompt:", id="empty"),
        pytest.param([1, -1], "^prompt:", id="negative"),
        pytest.param([1, 512], "^prompt:", id="beyond-vocab"),
        pytest.param([1, 2.5], "^prompt:", id="float"),
        pytest.param([1, "a"], "^prompt:", id="str"),
        pytest.param([1, True], "^prompt:", id="bool"),
        pytest.param([1, None], "^prompt:", id="none"),
        pytest.param(list(range(3, 131)), "^prompt:.*max_model_len", id="longer-than-context"),
    ],
)
def test_bad_prompts_name_the_field(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([tokens(3, 9), prompt], greedy())


def test_prompts_of_any_integer_type_are_accepted(llm):
    prompt = tokens(6, 12)
    ref = llm.generate([prompt], greedy(3))[0].token_ids
    as_numpy = np.array(prompt, dtype=np.int32)
    as_torch = torch.tensor(prompt)
    for p in (as_numpy, as_torch, [np.int64(t) for t in prompt], tuple(prompt)):
        out = llm.generate([p], greedy(3))[0]
        assert out.token_ids == ref and out.prompt_token_ids == prompt


@pytest.mark.parametrize("prompts", [[5, 6, 7], [None], [{"a": 1}], [b"abc"]])
def test_prompts_that_are_neither_text_nor_token_lists(llm, prompts):
    with pytest.raises(ValueError, match="^prompt:"):
        llm.generate(prompts, greedy())


def test_bad_sampling_params_name_the_field():
    with pytest.raises(ValueError, match="^max_tokens:"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="^top_p:"):
        SamplingParams(top_p=0.0)


def test_logit_bias_beyond_the_vocabulary_is_rejected(llm):
    vocab = llm.engine.model_cfg.vocab_size
    with pytest.raises(ValueError, match="^logit_bias:"):
        llm.generate([tokens(6, 3)], SamplingParams(max_tokens=2, logit_bias={vocab: 1.0}))
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_blocks
    ok = SamplingParams(max_tokens=2, temperature=0.0, logit_bias={vocab - 1: 100.0})
    assert llm.generate([tokens(6, 3)], ok)[0].token_ids == [vocab - 1, vocab - 1]


def test_max_tokens_beyond_the_pool_is_rejected(tiny_llama):
    small = LLM(model=str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=8)
    with pytest.raises(ValueError, match="^prompt:.*KV blocks"):
        small.generate([tokens(10, 1)], greedy(30))
    assert len(small.generate([tokens(10, 1)], greedy(22))[0].token_ids) == 22


def test_generation_stops_at_max_model_len(llm):
    out = llm.generate([tokens(120, 10)], greedy(50))[0]
    assert len(out.token_ids) == 8 and out.finish_reason == "length"


def test_unknown_option_and_missing_model(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="^max_batch_size:"):
        LLM(model=str(tiny_llama), max_batch_size=4)
    with pytest.raises(ValueError, match="^model:"):
        LLM(model="")
    with pytest.raises(ValueError, match="^model:"):
        LLM(model=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="^max_model_len:"):
        LLM(model=str(tiny_llama), max_model_len=4096)
    with pytest.raises(ValueError, match="^block_size:"):
        LLM(model=str(tiny_llama), block_size=0)


def test_string_prompts_and_text(llm_tok):
    tok = llm_tok.get_tokenizer()
    outs = llm_tok.generate(["Hello there", "The capital of France is"], greedy(10))
    assert [o.prompt for o in outs] == ["Hello there", "The capital of France is"]
    for o in outs:
        assert o.prompt_token_ids == tok.encode(o.prompt)
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
        assert o.text


def test_stop_strings_finish_with_the_stop_reason(llm_tok):
    tok = llm_tok.get_tokenizer()
    ref = llm_tok.generate(["Once upon a time"], greedy(16))[0]
    # A stop string that spans a token boundary, from the middle of the reference text.
    ids = ref.token_ids
    pieces = [tok.decode(ids[:i], skip_special_tokens=True) for i in range(len(ids) + 1)]
    cut = next(i for i in range(3, len(ids)) if len(pieces[i]) > len(pieces[i - 1]) + 1)
    boundary = len(pieces[cut - 1])
    stop = ref.text[boundary - 1 : boundary + 1]
    assert stop and len(stop) == 2
    out = llm_tok.generate(["Once upon a time"], greedy(16, stop=[stop]))[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.text == ref.text[: ref.text.index(stop)]
    assert stop not in out.text
    out = llm_tok.generate(
        ["Once upon a time"], greedy(16, stop=stop, include_stop_str_in_output=True)
    )[0]
    assert out.text == ref.text[: ref.text.index(stop) + len(stop)]


def test_token_prompts_work_with_a_tokenizer_model(llm_tok):
    tok = llm_tok.get_tokenizer()
    ids = tok.encode("Hello there")
    by_ids = llm_tok.generate([ids], greedy(5))[0]
    by_text = llm_tok.generate("Hello there", greedy(5))[0]
    assert by_ids.token_ids == by_text.token_ids
    assert by_ids.text == by_text.text and by_ids.prompt is None


def test_chat_applies_the_template(llm_tok):
    tok = llm_tok.get_tokenizer()
    messages = [{"role": "user", "content": "What is 2+2?"}]
    out = llm_tok.chat(messages, greedy(4))[0]
    expected = tok.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out.prompt_token_ids == list(expected)
    both = llm_tok.chat([messages, messages], greedy(4))
    assert [o.token_ids for o in both] == [out.token_ids] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a CPU-only machine")
def test_cuda_only_options_fail_clearly_without_cuda(tiny_llama):
    with pytest.raises(ValueError, match="^device:"):
        LLM(model=str(tiny_llama), device="cuda", num_kv_blocks=8)
    with pytest.raises(ValueError, match="^attention_backend:"):
        LLM(model=str(tiny_llama), attention_backend="flash", num_kv_blocks=8)
