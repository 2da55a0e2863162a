"""Schemas of vLLM's ``/tokenize`` and ``/detokenize`` routes."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool

from deployments.chat_protocol import Conversation
from deployments.protocol import TokenId
from deployments.request_limits import MAX_MESSAGE_CHARS


class TokenizeCompletionRequest(BaseModel):
    """``POST /tokenize`` with a prompt (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str = Field(max_length=MAX_MESSAGE_CHARS)
    add_special_tokens: StrictBool = True
    return_token_strs: StrictBool = False


class TokenizeChatRequest(Conversation):
    """``POST /tokenize`` with messages: the chat template's tokens, special tokens added only by
    the template unless ``add_special_tokens``."""

    model: str | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_MESSAGE_CHARS)]
