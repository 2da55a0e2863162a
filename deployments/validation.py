"""The one owner of request validation and prompt limits on the HTTP side.

``RequestValidator.completion`` and ``.chat`` turn a parsed JSON body into a ``GenerationJob``:
the prompts as token ids, the sampling parameters as a ``SamplingParams`` object and the response
builder. Every check a client can fail happens here, before any engine sees the request, and
fails with ``HTTPError`` naming the field: the model, body shape and the schema's bounds
(``deployments.request_limits``), tokenization, the chat template, token ids in range, prompt
length, context length, ``max_tokens``, and a request's sequences (prompts x n) against the
admission limit it would never fit under.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from deployments.chat_protocol import ChatCompletionRequest, Conversation
from deployments.config import AppArgs
from deployments.http_errors import HTTPError, validation_message
from deployments.openai_format import Echo, ResponseBuilder, ToolParsing
from deployments.protocol import CompletionRequest, ProtocolError, SamplingFields
from deployments.tokenize_protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from deployments.tool_calls import detect_format
from engine.model.config import model_config_from_hf
from engine.model.loader import load_hf_config, resolve_model, resolve_tokenizer
from engine.sampling_params import SamplingParams
from engine.scheduling_policy import uses_priority


@dataclass
class GenerationJob:
    """A validated request: one engine request per prompt, ``n`` choices each."""

    prompts: list[list[int]]
    params: SamplingParams
    builder: ResponseBuilder
    n: int
    stream: bool
    include_usage: bool
    priority: int
    cache_salt: str | None = None
    deadline_ms: float | None = None
    # The routing key of the conversation (``session_key``): the x-session-id header once the
    # frontend has read it, else the body's ``user``.
    session_id: str | None = None

    @property
    def num_sequences(self) -> int:
        """Sequences in the engines' batches: what admission counts."""
        return len(self.prompts) * self.n


class RequestValidator:
    """Holds the tokenizer and the limits; stateless per request."""

    def __init__(self, args: AppArgs) -> None:
        self.args = args
        model_dir = resolve_model(args.model)
        hf_config, generation_config = load_hf_config(model_dir)
        model_cfg = model_config_from_hf(hf_config, generation_config)
        self.vocab_size = model_cfg.vocab_size
        self.max_model_len = args.engine.max_model_len or model_cfg.max_position_embeddings
        self.tokenizer = resolve_tokenizer(args.tokenizer, model_dir)
        self.model_name = args.model_name

    # -- body --------------------------------------------------------------------------------
    def parse_json(self, body: bytes) -> Any:
        try:
            return json.loads(body)
        # ValueError covers integers too long to convert; RecursionError, deep nesting.
        except (ValueError, RecursionError) as e:
            raise HTTPError(400, f"body is not valid JSON: {e}") from e

    def _parse(self, model: type[BaseModel], body: Any) -> Any:
        if not isinstance(body, dict):
            raise HTTPError(400, "body must be a JSON object")
        try:
            return model.model_validate(body)
        except ValidationError as e:
            message, param = validation_message(e)
            raise HTTPError(400, message, param=param) from e

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise HTTPError(
                400,
                f"model: {name!r} is not served here (serving {self.model_name!r})",
                param="model",
                code="model_not_found",
            )

    # -- prompts -----------------------------------------------------------------------------
    def _tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if any(not 0 <= t < self.vocab_size for t in prompt):
                raise HTTPError(
                    400, f"prompt: token ids must be in [0, {self.vocab_size})", param="prompt"
                )
            return prompt
        if self.tokenizer is None:
            raise HTTPError(
                400, "prompt: this model has no tokenizer; send token ids", param="prompt"
            )
        try:
            return list(self.tokenizer.encode(prompt, add_special_tokens=True))
        except Exception as e:  # noqa: BLE001 - e.g. lone surrogates: the client's input
            raise HTTPError(400, f"prompt: cannot be tokenized: {e}", param="prompt") from e

    def _truncated(
        self, req: SamplingFields, prompt_ids: list[int], max_tokens: int | None
    ) -> list[int]:
        try:
            return req.truncated(prompt_ids, self.max_model_len, max_tokens)
        except ProtocolError as e:
            raise HTTPError(400, str(e), param=e.param) from e

    def _decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids)

    def _chat_tokens(self, req: Conversation) -> list[int]:
        """The conversation through the chat template (tools included), then tokenized; special
        tokens come from the template alone unless ``add_special_tokens``."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise HTTPError(
                400,
                "messages: this model has no chat template; use /v1/completions",
                param="messages",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                req.conversation(),
                tools=req.tool_definitions(),
                add_generation_prompt=req.generation_prompt,
                continue_final_message=req.continue_final_message,
                tokenize=False,
                **(req.chat_template_kwargs or {}),
            )
            ids = self.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        except Exception as e:  # noqa: BLE001 - template errors are the client's input
            raise HTTPError(400, f"messages: chat template failed: {e}", param="messages") from e
        return list(ids)

    def _tool_parsing(self, req: ChatCompletionRequest) -> ToolParsing | None:
        """How the output becomes ``tool_calls``: None when no call can be made."""
        choice = req.tool_choice_name
        if choice in (None, "none"):
            return None
        if choice == "auto":
            return ToolParsing(detect_format(getattr(self.tokenizer, "chat_template", None)))
        if choice == "required":
            return ToolParsing("required")
        return ToolParsing("named", choice)

    def _check_token_ids(self, params: SamplingParams) -> None:
        for name, ids in (
            ("logit_bias", params.logit_bias),
            ("allowed_token_ids", params.allowed_token_ids or ()),
            ("stop_token_ids", params.stop_token_ids),
        ):
            if any(t >= self.vocab_size for t in ids):
                raise HTTPError(
                    400, f"{name}: token ids must be in [0, {self.vocab_size})", param=name
                )

    def _check_sequences(self, num_prompts: int, n: int) -> None:
        """A request must fit under the admission limit on its own (``limits.
        max_ongoing_per_ingress`` counts sequences), or it would be refused with 429 forever."""
        limit = self.args.limits.max_ongoing_per_ingress
        if num_prompts * n > limit:
            param = "n" if n > 1 or num_prompts == 1 else "prompt"
            raise HTTPError(
                400,
                f"{param}: {num_prompts} prompt(s) x n={n} make {num_prompts * n} sequences; "
                f"this server admits at most {limit} at once",
                param=param,
            )

    def _check_lengths(
        self, prompt_ids: list[int], max_tokens: int, param: str, prompt_param: str = "prompt"
    ) -> None:
        """``param`` names the field that asked for ``max_tokens``, ``prompt_param`` the one that
        holds the prompt (``messages`` for chat): an error names the field to change."""
        if not prompt_ids:
            raise HTTPError(400, "prompt: must not be empty", param="prompt")
        limit = self.args.limits.max_prompt_tokens
        if limit and len(prompt_ids) > limit:
            raise HTTPError(
                400, f"prompt: {len(prompt_ids)} tokens exceed the limit of {limit}", param="prompt"
            )
        if len(prompt_ids) >= self.max_model_len:
            # No max_tokens could fit: the prompt is what must change (and chat's default
            # max_tokens, computed from the room left, was never the client's).
            raise HTTPError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"({prompt_param}) alone is {len(prompt_ids)} tokens, leaving no room to generate.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise HTTPError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {len(prompt_ids)} and {param} asks for {max_tokens} more.",
                param=param,
                code="context_length_exceeded",
            )
        if max_tokens > self.args.limits.max_tokens:
            raise HTTPError(
                400, f"{param}: must be at most {self.args.limits.max_tokens}", param=param
            )

    # -- requests ----------------------------------------------------------------------------
    def completion(self, body: Any) -> GenerationJob:
        req = self._parse(CompletionRequest, body)
        self._check_model(req.model)
        self._check_priority(req.priority)
        try:
            prompts = req.prompts()
            # OpenAI's default for completions, within the configured limit.
            params = req.to_sampling_params(default_max_tokens=min(16, self.args.limits.max_tokens))
        except ProtocolError as e:
            raise HTTPError(400, str(e), param=e.param) from e
        self._check_sequences(len(prompts), req.n)
        tokenized = [self._tokenize(p) for p in prompts]
        prompt_ids = [self._truncated(req, ids, req.max_tokens) for ids in tokenized]
        for ids in prompt_ids:
            self._check_lengths(ids, params.max_tokens, "max_tokens")
        self._check_token_ids(params)
        echo = None
        if req.echo:
            # A truncated prompt is echoed as the model saw it.
            echo = [
                Echo(p if isinstance(p, str) and len(ids) == len(whole) else self._decode(ids), ids)
                for p, whole, ids in zip(prompts, tokenized, prompt_ids, strict=True)
            ]
        builder = ResponseBuilder(
            "completion",
            f"cmpl-{uuid.uuid4().hex}",
            self.model_name,
            self.tokenizer,
            req.n,
            num_prompts=len(prompts),
            echo=echo,
            echo_only=req.echo_only,
            report_cached=self.args.report_cache_hits,
            tokens_as_ids=req.return_tokens_as_token_ids,
            continuous_usage=req.continuous_usage,
        )
        return self._job(req, prompt_ids, params, builder)

    def chat(self, body: Any) -> GenerationJob:
        req = self._parse(ChatCompletionRequest, body)
        self._check_model(req.model)
        self._check_priority(req.priority)
        self._check_sequences(1, req.n)
        requested = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        prompt_ids = self._truncated(req, self._chat_tokens(req), requested)
        # Chat defaults to "until the context is full", capped by the configured limit.
        default_max = max(1, min(self.args.limits.max_tokens, self.max_model_len - len(prompt_ids)))
        try:
            params = req.to_sampling_params(default_max_tokens=default_max)
        except ProtocolError as e:
            raise HTTPError(400, str(e), param=e.param) from e
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        self._check_lengths(prompt_ids, params.max_tokens, param, "messages")
        self._check_token_ids(params)
        builder = ResponseBuilder(
            "chat",
            f"chatcmpl-{uuid.uuid4().hex}",
            self.model_name,
            self.tokenizer,
            req.n,
            report_cached=self.args.report_cache_hits,
            tokens_as_ids=req.return_tokens_as_token_ids,
            continuous_usage=req.continuous_usage,
            tools=self._tool_parsing(req),
        )
        return self._job(req, [prompt_ids], params, builder)

    def _check_priority(self, priority: int) -> None:
        """As vLLM: a priority other than 0 is refused where the policy would ignore it."""
        policy = self.args.engine.scheduling_policy
        if priority != 0 and not uses_priority(policy):
            raise HTTPError(
                400,
                f"priority: got {priority}, but the scheduling policy {policy!r} does not "
                "order by priority (use priority or deadline)",
                param="priority",
            )

    def tokenize(self, body: Any) -> dict[str, Any]:
        """``POST /tokenize`` (vLLM's shape): a prompt, or messages through the chat template."""
        is_chat = isinstance(body, dict) and "messages" in body
        req = self._parse(TokenizeChatRequest if is_chat else TokenizeCompletionRequest, body)
        self._check_model(req.model)
        if is_chat:
            ids = self._chat_tokens(req)
        elif self.tokenizer is None:
            raise HTTPError(400, "prompt: this model has no tokenizer", param="prompt")
        else:
            try:
                ids = list(
                    self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
                )
            except Exception as e:  # noqa: BLE001 - e.g. lone surrogates: the client's input
                raise HTTPError(400, f"prompt: cannot be tokenized: {e}", param="prompt") from e
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        if req.return_token_strs:
            out["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return out

    def detokenize(self, body: Any) -> dict[str, Any]:
        """``POST /detokenize`` (vLLM's shape): token ids back to text."""
        req = self._parse(DetokenizeRequest, body)
        self._check_model(req.model)
        if self.tokenizer is None:
            raise HTTPError(400, "tokens: this model has no tokenizer", param="tokens")
        if any(t >= self.vocab_size for t in req.tokens):
            raise HTTPError(
                400, f"tokens: token ids must be in [0, {self.vocab_size})", param="tokens"
            )
        return {"prompt": self._decode(req.tokens)}

    @staticmethod
    def _job(
        req: Any, prompts: list[list[int]], params: SamplingParams, builder: ResponseBuilder
    ) -> GenerationJob:
        return GenerationJob(
            prompts=prompts,
            params=params,
            builder=builder,
            n=req.n,
            stream=bool(req.stream),
            include_usage=req.include_usage,
            priority=req.priority,
            cache_salt=req.cache_salt,
            deadline_ms=req.deadline_ms,
            session_id=session_key(None, req.user),
        )


# Longer session keys are routed by their digest: the router keeps one entry per session.
MAX_SESSION_KEY_CHARS = 128


def session_header(headers: Mapping[str, str]) -> str | None:
    """Ray Serve's session header (``x-session-id`` unless ``RAY_SERVE_SESSION_ID_HEADER_KEY``
    renames it; ``-`` and ``_`` alike, as Serve's HAProxy and LLM router match it)."""
    try:
        from ray.serve._private.http_util import session_id_from_headers
    except ImportError:  # pragma: no cover - private API; the documented default then
        return next(
            (v for k, v in headers.items() if k.lower().replace("_", "-") == "x-session-id"),
            None,
        )
    return session_id_from_headers(dict(headers.items()))


def session_key(header: str | None, user: str | None) -> str | None:
    """The conversation a request belongs to: the session header, else the OpenAI ``user``
    field; None for neither (or empty). Keys past ``MAX_SESSION_KEY_CHARS`` become their
    SHA-256, so that a client cannot grow the router's session table by sending long ones."""
    key = header or user
    if not key:
        return None
    if len(key) > MAX_SESSION_KEY_CHARS:
        return "sha256:" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return key
