"""Bounds on the size of one request, enforced by the request schema (``deployments.protocol``).

Each bound is generous for an OpenAI or vLLM client (OpenAI itself allows 4 stop strings and 300
``logit_bias`` entries) and keeps what one request can make the engine do per token small and
known: every sequence of a request is a row of the shared batch, every stop string is matched
against every sequence's new text, and every ``logit_bias`` entry is added to every row.
Requests past a bound get a 400 naming the field. The body itself is bounded separately by
``limits.max_body_bytes`` (``deployments.config``).
"""

from __future__ import annotations

# Choices per request (OpenAI allows 128; each choice is a sequence in the engine's batch).
MAX_N = 16
# Prompts in one /v1/completions request; each is an engine request of its own, routed alone.
MAX_PROMPTS = 32
# Sequences per request: prompts x n. Each takes a row of an engine replica's batch and a unit of
# admission (``limits.max_ongoing_per_ingress`` counts sequences). Half the default running batch
# (``engine.max_num_seqs`` 64): one request alone never fills it, so others still get a row.
MAX_SEQUENCES = 32
# Stop strings per request, and characters per stop string. The longest stop string also sets how
# much text a stream holds back (it could be the start of a stop string).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
# Entries of stop_token_ids.
MAX_STOP_TOKEN_IDS = 64
# Entries of bad_words (vLLM's field; each is matched against every sequence's output per step),
# of at most MAX_STOP_STRING_CHARS characters each.
MAX_BAD_WORDS = 64
# Entries of logit_bias (OpenAI's own bound).
MAX_LOGIT_BIAS = 300
# Entries of allowed_token_ids (vLLM's field): a mask over the vocabulary is built from them.
MAX_ALLOWED_TOKEN_IDS = 1 << 18
# Chat messages per request, characters of one message's content, and content parts of one message.
MAX_MESSAGES = 1024
MAX_MESSAGE_CHARS = 1 << 20
MAX_CONTENT_PARTS = 256
# Characters of a cache_salt (vLLM's field: requests with different salts share no cached KV).
MAX_CACHE_SALT_CHARS = 256

# A request's deadline_ms (its first token's): at most a day.
MAX_DEADLINE_MS = 86_400_000

# Integers that reach native code (a seed becomes a torch generator's 64-bit state) or a
# scheduler key must fit a signed 64-bit integer; JSON allows any size.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
# Tools in a request, and tool calls in one message sent back.
MAX_TOOLS = 128
