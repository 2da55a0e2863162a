"""Hypothesis strategies for fuzzing the OpenAI-compatible HTTP API.

A fuzzed request is ``(kind, method, path, payload, extra)``: ``json`` bodies (valid ones, valid
ones with one field replaced by any JSON value, and wild ones, with various content types),
``raw`` bytes (random, or crafted: deep nesting, overlong integers, lone surrogates), ``huge``
bodies past ``MAX_BODY`` (``extra``: sent chunked, without Content-Length), and ``route`` for
other methods and paths.
"""

from __future__ import annotations

from hypothesis import strategies as st

MAX_TOKENS = 8
MAX_BODY = 32 * 1024

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)


def field(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly plausible values, sometimes any JSON at all."""
    return st.one_of(valid, valid, valid, json_values)


token_ids = st.lists(st.integers(min_value=-3, max_value=50000), max_size=40)
small_ints = st.integers(min_value=-2, max_value=MAX_TOKENS + 3)
sampling_fields = {
    "model": field(st.sampled_from(["tiny", "tiny", "gpt-4"])),
    "max_tokens": field(small_ints),
    "temperature": field(st.floats(min_value=-1, max_value=3)),
    "top_p": field(st.floats(min_value=-0.5, max_value=1.5)),
    "top_k": field(st.integers(min_value=-2, max_value=60000)),
    "min_tokens": field(small_ints),
    "seed": field(st.integers(min_value=-(2**65), max_value=2**65)),
    "stop": field(st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3))),
    "stop_token_ids": field(token_ids),
    "ignore_eos": field(st.booleans()),
    "stream": field(st.booleans()),
    "stream_options": field(
        st.fixed_dictionaries(
            {"include_usage": st.booleans()}, optional={"continuous_usage_stats": st.booleans()}
        )
    ),
    "n": field(st.integers(min_value=0, max_value=3)),
    "priority": field(st.integers(min_value=-(2**40), max_value=2**40)),
    "presence_penalty": field(st.floats(min_value=-3, max_value=3)),
    "frequency_penalty": field(st.floats(min_value=-3, max_value=3)),
    "repetition_penalty": field(st.floats(min_value=-1, max_value=3)),
    "min_p": field(st.floats(min_value=-0.5, max_value=1.5)),
    "logit_bias": field(
        st.dictionaries(
            st.one_of(st.text(max_size=3), st.integers(-5, 60000).map(str)),
            st.floats(-150, 150),
            max_size=3,
        )
    ),
    "user": field(st.text(max_size=8)),
    "allowed_token_ids": field(token_ids),
    "bad_words": field(st.lists(st.text(max_size=6), max_size=3)),
    "truncate_prompt_tokens": field(st.integers(min_value=-3, max_value=70000)),
    "truncation_side": field(st.sampled_from(["left", "right", "middle"])),
    "return_tokens_as_token_ids": field(st.booleans()),
    "unknown_field": json_values,
    # Output constraints: odd regexes, choices and schemas must be a 400 or a bounded output.
    "guided_regex": field(st.one_of(st.text(max_size=8), st.sampled_from(["", "a*", "[^\\s\\S]"]))),
    "guided_choice": field(st.lists(st.text(max_size=4), max_size=3)),
    "guided_json": field(
        st.fixed_dictionaries({"type": st.sampled_from(["object", "string", "nope"])})
    ),
    "response_format": field(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json", "json_object", "json_schema"])},
            optional={"json_schema": st.fixed_dictionaries({"schema": json_values})},
        )
    ),
}
text_prompts = st.text(max_size=60)
completion_body = st.fixed_dictionaries(
    {},
    optional={
        **sampling_fields,
        "prompt": field(
            st.one_of(
                text_prompts,
                token_ids,
                st.lists(text_prompts, max_size=2),
                st.lists(token_ids, max_size=2),
            )  # fmt: skip
        ),
        "logprobs": field(st.integers(min_value=-1, max_value=25)),
        "echo": field(st.booleans()),
        "suffix": field(st.text(max_size=4)),
    },
)
message = st.fixed_dictionaries(
    {
        "role": field(st.sampled_from(["system", "developer", "user", "assistant", "tool", "x"])),
        "content": field(
            st.one_of(
                st.none(),
                text_prompts,
                st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text_prompts})),
            )
        ),
    },
    optional={"name": field(st.text(max_size=5))},
)
chat_body = st.fixed_dictionaries(
    {},
    optional={
        **sampling_fields,
        "messages": field(st.lists(message, max_size=3)),
        "max_completion_tokens": field(small_ints),
        "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(min_value=-1, max_value=25)),
        "tools": field(
            st.lists(
                st.fixed_dictionaries(
                    {
                        "type": st.just("function"),
                        "function": st.fixed_dictionaries(
                            {"name": st.sampled_from(["f", "g", "bad name"])},
                            optional={"parameters": json_values},
                        ),
                    }
                ),
                max_size=2,
            )
        ),
        "tool_choice": field(st.sampled_from(["none", "auto", "required", "f"])),
        "add_generation_prompt": field(st.booleans()),
        "continue_final_message": field(st.booleans()),
        "chat_template_kwargs": field(
            st.dictionaries(st.sampled_from(["enable_thinking", "tokenize", "x"]), json_values)
        ),
    },
)
GEN_PATHS = ["/v1/completions", "/v1/chat/completions"]

# Valid requests, so that the serving path itself is fuzzed too, and valid requests with one
# field replaced by any JSON value.
valid_sampling = {
    "max_tokens": st.integers(min_value=1, max_value=MAX_TOKENS),
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.05, max_value=1),
    "top_k": st.integers(min_value=-1, max_value=100),
    "min_tokens": st.integers(min_value=0, max_value=1),
    "seed": st.integers(min_value=0, max_value=2**31),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "ignore_eos": st.booleans(),
    "priority": st.integers(min_value=-5, max_value=5),
    "user": st.text(max_size=5),
    "presence_penalty": st.floats(min_value=-2, max_value=2),
    "frequency_penalty": st.floats(min_value=-2, max_value=2),
    "repetition_penalty": st.floats(min_value=0.5, max_value=2),
    "min_p": st.floats(min_value=0, max_value=1),
    "logit_bias": st.dictionaries(st.integers(0, 500).map(str), st.floats(-100, 100), max_size=3),
    "allowed_token_ids": st.lists(st.integers(min_value=3, max_value=500), min_size=1, max_size=5),
    "bad_words": st.lists(st.text(min_size=1, max_size=5).filter(str.strip), max_size=2),
    "truncate_prompt_tokens": st.integers(min_value=1, max_value=30),
}
valid_completion = st.fixed_dictionaries(
    {
        "model": st.just("tiny"),
        "prompt": st.one_of(
            st.text(min_size=1, max_size=60),
            st.lists(st.integers(min_value=3, max_value=49000), min_size=1, max_size=40),
            st.lists(st.text(min_size=1, max_size=30), min_size=1, max_size=3),
            st.lists(
                st.lists(st.integers(min_value=3, max_value=49000), min_size=1, max_size=20),
                min_size=1,
                max_size=3,
            ),
        ),
    },
    optional={
        **valid_sampling,
        "logprobs": st.integers(min_value=0, max_value=5),
        "echo": st.booleans(),
    },
)
valid_chat = st.fixed_dictionaries(
    {
        "model": st.just("tiny"),
        "messages": st.lists(
            st.fixed_dictionaries(
                {
                    "role": st.sampled_from(["system", "user", "assistant"]),
                    "content": st.text(max_size=40),
                }
            ),
            min_size=1,
            max_size=3,
        ),
    },
    optional={
        **valid_sampling,
        "max_completion_tokens": st.integers(min_value=1, max_value=MAX_TOKENS),
        "logprobs": st.booleans(),
    },
)


def streamed(bodies: st.SearchStrategy) -> st.SearchStrategy:
    return st.tuples(bodies, st.booleans(), st.booleans()).map(
        lambda t: (
            {**t[0], "stream": True, "stream_options": {"include_usage": t[2]}} if t[1] else t[0]
        )
    )


def mutated(bodies: st.SearchStrategy, names: list[str]) -> st.SearchStrategy:
    return st.tuples(bodies, st.sampled_from(names), json_values).map(
        lambda t: {**t[0], t[1]: t[2]}
    )


MUTABLE = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "stream", "stop"]
completion_bodies = st.one_of(
    streamed(valid_completion),
    streamed(valid_completion),
    mutated(streamed(valid_completion), MUTABLE),
    completion_body,
)
chat_bodies = st.one_of(
    streamed(valid_chat), streamed(valid_chat), mutated(streamed(valid_chat), MUTABLE), chat_body
)
CONTENT_TYPES = [
    "application/json",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=latin-1",
]

# A request: (kind, method, path, payload, content type).
fuzz_request = st.one_of(
    st.tuples(st.just("json"), st.just("POST"), st.just("/v1/completions"), completion_bodies,
              st.just("application/json")),
    st.tuples(st.just("json"), st.just("POST"), st.just("/v1/chat/completions"), chat_bodies,
              st.just("application/json")),
    st.tuples(st.just("json"), st.just("POST"), st.just("/v1/completions"), completion_bodies,
              st.just("application/json")),
    st.tuples(st.just("json"), st.just("POST"), st.just("/v1/chat/completions"), chat_bodies,
              st.just("application/json")),
    st.tuples(st.just("json"), st.just("POST"), st.sampled_from(GEN_PATHS), json_values,
              st.sampled_from(CONTENT_TYPES)),
    st.tuples(st.just("raw"), st.just("POST"), st.sampled_from(GEN_PATHS),
              st.binary(max_size=300), st.sampled_from(CONTENT_TYPES)),
    st.tuples(st.just("raw"), st.just("POST"), st.sampled_from(GEN_PATHS),
              st.sampled_from([b"[" * 30000, b'{"prompt": 1' + b"1" * 9000 + b"}",
                               b'{"model": "tiny", "prompt": "\\ud800"}',
                               b'{"model":"tiny","prompt":"a","max_tokens":1e400}']),
              st.just("application/json")),
    st.tuples(st.just("huge"), st.just("POST"), st.sampled_from(GEN_PATHS),
              st.integers(min_value=MAX_BODY + 1, max_value=8 * MAX_BODY), st.booleans()),
    st.tuples(st.just("route"), st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]),
              st.sampled_from([*GEN_PATHS, "/v1/models", "/metrics", "/v1", "/x/../v1/models",
                               "/v1/completions/extra", "/%00", "/" + "a" * 3000]),
              st.none(), st.none()),
)  # fmt: skip
