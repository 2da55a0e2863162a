"""The fields every generation request shares (``SamplingFields``), the completions request,
and their mapping onto SamplingParams; the chat request builds on them in
``deployments.chat_protocol``.

Unknown fields are ignored, as OpenAI's own API and vLLM do, so that any client works; fields we
know but do not implement (``suffix``, ``best_of``) are rejected with a 400 naming the
field rather than silently ignored. ``logit_bias`` keys are token ids written as strings, as
OpenAI's API sends them.

Structured output: OpenAI's ``response_format`` (``json_object``, ``json_schema``) and vLLM's
``structured_outputs`` object and older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar`` fields; at most one of them per request, compiled here so that a bad schema
is a 400 naming its field. A chat request's ``tool_choice`` of ``required`` or a named function
becomes a structured output too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StringConstraints,
    field_validator,
)

from deployments.output_fields import (
    ResponseFormat,
    StructuredOutputsField,
)
from deployments.request_limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT_CHARS,
    MAX_DEADLINE_MS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_PROMPTS,
    MAX_SEQUENCES,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)
from engine.sampling_params import MAX_LOGPROBS, SamplingParams
from engine.structured_output import StructuredOutputs

# An integer that must fit a signed 64-bit one (it reaches native code or a sort key).
Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_STRING_CHARS)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]


class ProtocolError(ValueError):
    """An invalid request: becomes a 400 with ``param`` naming the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False
    # vLLM's field: with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: StrictBool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    min_tokens: Int64 = 0
    seed: Int64 | None = None
    # One string or a list; a string arrives here as a list of one (see _stop_as_list).
    stop: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    bad_words: Annotated[list[StopString], Field(max_length=MAX_BAD_WORDS)] | None = None
    allowed_token_ids: (
        Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None
    ) = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # vLLM's field: lower is more urgent (used by the priority and deadline policies).
    priority: Int64 = 0
    # Milliseconds from arrival at the engine by which the first token is due (SLO class);
    # the deadline policy serves earlier deadlines first, and a server that rejects late
    # requests answers 429 once it has passed.
    deadline_ms: Annotated[float, Field(gt=0, le=MAX_DEADLINE_MS, strict=False)] | None = None
    user: str | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    return_tokens_as_token_ids: StrictBool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's fields: keep this many prompt tokens (-1: as many as leave room for max_tokens and
    # one more), the last ones unless truncation_side is "right".
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None

    @field_validator("deadline_ms", mode="before")
    @classmethod
    def _deadline_is_a_number(cls, v: Any) -> Any:
        # Lax float parsing would take "100" or true.
        if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
            raise ValueError("must be a number of milliseconds")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        # A union of str and list[str] would report a list's errors after the str branch's
        # "Input should be a valid string"; one list type names the real fault.
        return [v] if isinstance(v, str) else v

    def truncated(
        self, prompt_ids: list[int], max_model_len: int, max_tokens: int | None
    ) -> list[int]:
        """The prompt as ``truncate_prompt_tokens`` cuts it (vLLM's rule: room is kept for the
        requested ``max_tokens``, none asked for meaning none kept)."""
        keep = self.truncate_prompt_tokens
        if keep is None:
            return prompt_ids
        room = max_model_len - (max_tokens or 0)
        if keep == -1:
            keep = room - 1
        if not 1 <= keep <= room:
            raise ProtocolError(
                f"truncate_prompt_tokens: must be -1 or in [1, {room}] (the context length "
                f"{max_model_len} less max_tokens), got {self.truncate_prompt_tokens}",
                "truncate_prompt_tokens",
            )
        return prompt_ids[:keep] if self.truncation_side == "right" else prompt_ids[-keep:]

    def _check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ProtocolError(
                "stream_options: only allowed when stream is true", "stream_options"
            )

    def _constraints(self) -> list[tuple[str, StructuredOutputs]]:
        """Each structured-output field the request sets, with the constraint it asks for."""
        found: list[tuple[str, StructuredOutputs]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutputs(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ProtocolError(
                    "response_format: json_schema.schema is required for type json_schema",
                    "response_format",
                )
            found.append(("response_format", StructuredOutputs(json=rf.json_schema.schema_)))
        so = self.structured_outputs
        if so is not None:
            kwargs: dict[str, Any] = {
                "json": so.json_,
                "regex": so.regex,
                "choice": so.choice,
                "grammar": so.grammar,
                "json_object": bool(so.json_object),
            }
            try:
                found.append(("structured_outputs", StructuredOutputs(**kwargs)))
            except ValueError as e:
                raise ProtocolError(str(e), "structured_outputs") from None
        for name, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            value = getattr(self, name)
            if value is not None:
                found.append((name, StructuredOutputs(**{key: value})))
        return found

    def structured_output(
        self, extra: tuple[str, StructuredOutputs] | None = None
    ) -> StructuredOutputs | None:
        """The one constraint on the output (``extra``: one from another field, e.g.
        ``tool_choice``), checked to compile; a 400 naming the field otherwise."""
        found = self._constraints() + ([extra] if extra else [])
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise ProtocolError(
                f"{found[1][0]}: only one structured output per request ({names} given)",
                found[1][0],
            )
        if not found:
            return None
        name, spec = found[0]
        try:
            spec.check()
        except ValueError as e:
            raise ProtocolError(f"{name}: {e}", name) from None
        return spec

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        default_max_tokens: int,
        structured_outputs: StructuredOutputs | None = None,
    ) -> SamplingParams:
        self._check_unsupported()
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens if max_tokens is not None else default_max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if self.top_k is None else self.top_k,
            "min_p": self.min_p or 0.0,
            "presence_penalty": self.presence_penalty or 0.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "repetition_penalty": (
                1.0 if self.repetition_penalty is None else self.repetition_penalty
            ),
            "logit_bias": self._logit_bias(),
            "min_tokens": self.min_tokens,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "structured_outputs": structured_outputs,
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
        }
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            field = str(e).split(":", 1)[0]
            raise ProtocolError(str(e), field if field in kwargs else None) from e

    def _logit_bias(self) -> dict[int, float]:
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise ProtocolError(
                    f"logit_bias: keys must be token ids, got {key!r}", "logit_bias"
                ) from None
            bias[token] = value
        return bias

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(
            self.stream_options and self.stream_options.continuous_usage_stats
        )


class CompletionRequest(SamplingFields):
    """``prompt`` is one prompt (a string or token ids) or a list of them; choice ``i * n + k``
    of the response is prompt ``i``'s choice ``k``. ``echo`` puts the prompt before each
    choice's text, and with ``logprobs`` the prompt tokens' logprobs before the completion's
    (the first token's is null); ``echo`` with ``max_tokens: 0`` scores the prompt alone."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: Int64 | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: Int64 | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        several = isinstance(p, list) and p and isinstance(p[0], str | list)
        batch: list = list(p) if several else [p]  # type: ignore[arg-type]
        if len(batch) > MAX_PROMPTS:
            raise ProtocolError(f"prompt: at most {MAX_PROMPTS} prompts per request", "prompt")
        if len(batch) * self.n > MAX_SEQUENCES:
            raise ProtocolError(
                f"n: {len(batch)} prompts x n={self.n} make {len(batch) * self.n} sequences; "
                f"at most {MAX_SEQUENCES} per request",
                "n",
            )
        if any(not x for x in batch):
            raise ProtocolError("prompt: must not be empty", "prompt")
        return [x if isinstance(x, str) else list(x) for x in batch]

    @property
    def echo_only(self) -> bool:
        """The prompt echoed, nothing generated (``max_tokens: 0``)."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.suffix:
            raise ProtocolError("suffix: not supported", "suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise ProtocolError(f"best_of: must be at least n ({self.n})", "best_of")
        if self.best_of not in (None, 1):
            raise ProtocolError("best_of: not supported", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ProtocolError(f"logprobs: must be in [0, {MAX_LOGPROBS}]", "logprobs")
        # The engine always produces a token; with echo_only the response leaves it out.
        max_tokens = 1 if self.echo_only else self.max_tokens
        params = self.sampling_params(
            max_tokens, self.logprobs, default_max_tokens, self.structured_output()
        )
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = self.logprobs
        return params
