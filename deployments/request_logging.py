"""The ids of the request being served, in every Serve log line written while serving it.

The HTTP side binds the client's ``x-request-id`` header and, once the body is parsed, the
response id (``cmpl-...`` / ``chatcmpl-...``) in a context variable; ``EngineRequest`` carries
both to the engine replica, which binds them again around the request's generator. The filter
on Serve's logger (``ray.serve``, the one every module here logs to and Serve writes to its
replica log files) then puts them into each record written in that context:

* as record attributes ``response_id`` and ``x_request_id``, which Serve's JSON encoding
  (``logging_config: {encoding: JSON}``) writes as keys of their own;
* as a ``[<response id> x-request-id=<id>]`` prefix of the message, which Serve's text
  format otherwise has no place for.

Asyncio tasks copy the context when they are created, so work a request spawns (a prompt's own
task, a stream's pump) carries the ids too, and one request's ids never leak into another's.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace

SERVE_LOGGER = "ray.serve"


@dataclass(frozen=True)
class RequestIds:
    response_id: str | None = None
    x_request_id: str | None = None

    def prefix(self) -> str:
        parts = [p for p in (self.response_id,) if p]
        if self.x_request_id:
            parts.append(f"x-request-id={self.x_request_id}")
        return f"[{' '.join(parts)}] " if parts else ""


_current: contextvars.ContextVar[RequestIds | None] = contextvars.ContextVar(
    "prefixserve_request_ids", default=None
)


def current() -> RequestIds:
    return _current.get() or RequestIds()


def bind(
    response_id: str | None = None, x_request_id: str | None = None
) -> contextvars.Token[RequestIds | None]:
    """Set the ids for the rest of this context (None keeps what is bound already)."""
    ids = current()
    if response_id is not None:
        ids = replace(ids, response_id=response_id)
    if x_request_id is not None:
        ids = replace(ids, x_request_id=x_request_id)
    return _current.set(ids)


@contextlib.contextmanager
def bound(response_id: str | None = None, x_request_id: str | None = None) -> Iterator[None]:
    """The ids bound inside the block only."""
    token = bind(response_id, x_request_id)
    try:
        yield
    finally:
        _current.reset(token)


class RequestIdsFilter(logging.Filter):
    """Adds the bound ids to each record (see the module docstring); drops nothing."""

    # Recognised by attribute: Serve may load this module more than once (classes by value).
    is_request_ids_filter = True

    def filter(self, record: logging.LogRecord) -> bool:
        ids = _current.get()
        if ids is None or getattr(record, "response_id", None) is not None:
            return True
        record.response_id = ids.response_id
        record.x_request_id = ids.x_request_id
        prefix = ids.prefix()
        if prefix and isinstance(record.msg, str):
            record.msg = prefix + record.msg
        return True


def install(logger_name: str = SERVE_LOGGER) -> None:
    """Add the filter to Serve's logger once per process (Serve reconfigures the logger's
    handlers, never its filters)."""
    logger = logging.getLogger(logger_name)
    if not any(getattr(f, "is_request_ids_filter", False) for f in logger.filters):
        logger.addFilter(RequestIdsFilter())
