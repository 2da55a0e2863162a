"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import copy
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.stop_strings import StopStrings
from engine.structured_output import StructuredOutputs

MAX_LOGPROBS = 20
# OpenAI's ranges.
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
# What torch.Generator.manual_seed takes: any integer that fits 64 bits, signed or not.
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature == 0`` is greedy. ``top_k`` 0 or -1, ``top_p == 1`` and ``min_p == 0`` disable
    those filters (``min_p`` drops tokens less likely than ``min_p`` times the most likely one).
    Before sampling (and before the greedy argmax) the logits are adjusted in this order:
    ``logit_bias`` (token id -> added value); ``repetition_penalty`` on every token of the prompt
    and the output (positive logits divided by it, negative ones multiplied); then
    ``frequency_penalty`` times the token's count in the output and ``presence_penalty`` once if
    it occurs there, both subtracted.
    ``logprobs=None`` returns none; ``logprobs=k`` returns the sampled token's log-probability and
    the ``k`` most likely alternatives (``k = 0``: the sampled token's only).
    ``prompt_logprobs=k`` does the same for every prompt token after the first (the first has no
    context to be predicted from), from the model's raw distribution; such a request computes
    its whole prompt, since KV found in the prefix cache carries no logits.
    ``structured_outputs`` constrains the output to a grammar (JSON schema, regex, choices): each
    step samples only tokens it allows, and the request stops when the grammar is complete.

    ``allowed_token_ids`` (vLLM's) leaves only those tokens to sample, and ``bad_words`` (vLLM's)
    bans the tokens that would complete one of those words (``engine.bad_words``), both before
    the adjustments.

    After construction ``stop`` is a ``StopStrings``, ``stop_token_ids`` and
    ``allowed_token_ids`` frozensets, ``bad_words`` a tuple; they and ``logit_bias`` are never
    changed afterwards, so copies (``with_seed``: a request's choices)
    share them instead of copying and re-validating them.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    seed: int | None = None
    stop: StopStrings | list[str] | tuple[str, ...] | str | None = None
    stop_token_ids: Collection[int] = frozenset()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None
    # vLLM's field: only these tokens may be sampled (None: any).
    allowed_token_ids: Collection[int] | None = None
    # vLLM's field: words the output may not contain (engine.bad_words).
    bad_words: Collection[str] | None = None

    def __post_init__(self) -> None:
        try:
            self.stop = StopStrings.of(self.stop)
        except TypeError:
            raise ValueError("stop: must be a string or a list of strings") from None
        try:
            self.stop_token_ids = frozenset(self.stop_token_ids or ())
        except TypeError:
            raise ValueError("stop_token_ids: must be non-negative integers") from None
        self.logit_bias = dict(self.logit_bias or {})
        if self.bad_words is not None:
            if isinstance(self.bad_words, str):
                raise ValueError("bad_words: must be a list of strings")
            self.bad_words = tuple(self.bad_words)
        if self.allowed_token_ids is not None:
            try:
                self.allowed_token_ids = frozenset(self.allowed_token_ids)
            except TypeError:
                raise ValueError("allowed_token_ids: must be token ids >= 0") from None
        self.validate()

    def with_seed(self, seed: int) -> SamplingParams:
        """A copy that differs only in ``seed``; it shares the stop strings, stop token ids and
        logit bias (immutable) rather than copying them."""
        _check_seed(seed)
        clone = copy.copy(self)
        clone.seed = seed
        return clone

    def logit_bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``logit_bias`` as token ids (int64) and values (float64), built on first use and kept:
        the engine adds them to the request's row of logits at every step."""
        arrays = self.__dict__.get("_logit_bias_arrays")
        if arrays is None:
            count = len(self.logit_bias)
            arrays = (
                np.fromiter(self.logit_bias.keys(), dtype=np.int64, count=count),
                np.fromiter(self.logit_bias.values(), dtype=np.float64, count=count),
            )
            self.__dict__["_logit_bias_arrays"] = arrays
        return arrays

    def allowed_token_array(self) -> np.ndarray:
        """``allowed_token_ids`` as int64 token ids, built on first use and kept."""
        array = self.__dict__.get("_allowed_token_array")
        if array is None:
            ids = self.allowed_token_ids or ()
            array = np.fromiter(ids, dtype=np.int64, count=len(ids))
            self.__dict__["_allowed_token_array"] = array
        return array

    def __getstate__(self) -> dict[str, Any]:
        # Derived arrays stay behind: pickles (to another process) and copies rebuild them.
        state = dict(self.__dict__)
        state.pop("_logit_bias_arrays", None)
        state.pop("_allowed_token_array", None)
        return state

    def validate(self) -> None:
        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_number(v: object) -> bool:
            return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens: must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens: must not exceed max_tokens")
        if not isinstance(self.temperature, int | float) or not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature: must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k):
            raise ValueError(f"top_k: must be an integer, got {self.top_k!r}")
        if self.top_k < -1:
            # As vLLM: -1 and 0 turn it off; anything lower is a mistake, not a setting.
            raise ValueError(f"top_k: must be 0 or -1 (off) or at least 1, got {self.top_k}")
        if not is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p: must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -MAX_ABS_PENALTY <= value <= MAX_ABS_PENALTY:
                raise ValueError(
                    f"{name}: must be in [-{MAX_ABS_PENALTY}, {MAX_ABS_PENALTY}], got {value!r}"
                )
        if not is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty: must be a positive number, got {self.repetition_penalty!r}"
            )
        for token, bias in self.logit_bias.items():
            if not is_int(token) or token < 0:
                raise ValueError(f"logit_bias: keys must be token ids >= 0, got {token!r}")
            if not is_number(bias) or not -MAX_ABS_LOGIT_BIAS <= bias <= MAX_ABS_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias: values must be in [-{MAX_ABS_LOGIT_BIAS}, "
                    f"{MAX_ABS_LOGIT_BIAS}], got {bias!r}"
                )
        if self.seed is not None:
            _check_seed(self.seed)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}: must be an integer in [0, {MAX_LOGPROBS}]")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids: must be non-negative integers")
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids
            or any(not is_int(t) or t < 0 for t in self.allowed_token_ids)
        ):
            raise ValueError("allowed_token_ids: must be one or more token ids >= 0")
        if self.bad_words is not None and any(
            not isinstance(w, str) or not w.strip() for w in self.bad_words
        ):
            raise ValueError("bad_words: every bad word must be a non-blank string")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputs
        ):
            raise ValueError("structured_outputs: must be a StructuredOutputs")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty, a bias, an allowed set or bad words change the logits (and so can
        change a greedy pick)."""
        return bool(
            self.logit_bias
            or self.allowed_token_ids
            or self.bad_words
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @property
    def stop_strings(self) -> StopStrings:
        assert isinstance(self.stop, StopStrings)
        return self.stop


def _check_seed(seed: object) -> None:
    """What torch.Generator.manual_seed accepts: an int (not a bool) in [SEED_MIN, SEED_MAX]."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"seed: must be an integer in [{SEED_MIN}, {SEED_MAX}], got {seed!r}")
