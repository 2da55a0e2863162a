"""Which session a request belongs to, as the HTTP side reads it (no cluster)."""

from __future__ import annotations

import hashlib

from starlette.datastructures import Headers

from deployments.validation import MAX_SESSION_KEY_CHARS, session_header, session_key


def test_the_session_header_is_serves_own_name_in_any_spelling() -> None:
    assert session_header(Headers({"x-session-id": "c1"})) == "c1"
    assert session_header(Headers({"X-Session-Id": "c2"})) == "c2"
    # Proxies that swap '-' for '_' (nginx, API gateways) must not lose the session.
    assert session_header(Headers({"x_session_id": "c3"})) == "c3"
    assert session_header(Headers({"x-request-id": "r1"})) is None


def test_the_header_wins_over_the_user_field() -> None:
    assert session_key("conversation", "alice") == "conversation"
    assert session_key(None, "alice") == "alice"
    assert session_key("", "alice") == "alice"
    assert session_key(None, None) is None
    assert session_key(None, "") is None


def test_long_session_keys_are_routed_by_their_digest() -> None:
    long = "u" * (MAX_SESSION_KEY_CHARS + 1)
    key = session_key(None, long)
    assert key == "sha256:" + hashlib.sha256(long.encode()).hexdigest()
    assert session_key(None, "u" * MAX_SESSION_KEY_CHARS) == "u" * MAX_SESSION_KEY_CHARS
    # Unpaired surrogates (valid JSON strings) must not crash the digest.
    assert session_key(None, "\ud800" * 200 + "x").startswith("sha256:")
