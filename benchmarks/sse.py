"""A small incremental Server-Sent Events decoder (the subset OpenAI-style streams use).

Follows the WHATWG event-stream rules for ``data``/``event`` fields and comments: an event is
dispatched at a blank line, several ``data:`` lines of one event are joined with ``\\n``, one
leading space after the colon is dropped, lines starting with ``:`` are comments. Each event
carries the time its first line arrived, which is what latency measurements want (a server
writes an event's lines in one go; the blank line may come in a later read).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SSEEvent:
    data: str
    event: str = "message"
    # Caller-supplied clock reading when the event's first line arrived (None if not given).
    time: float | None = None


class SSEDecoder:
    """Feed it lines without their terminators; it returns an event when one completes.

    Invariant: between events, ``_data`` holds the data lines of the pending event and ``_time``
    the arrival time of its first line (None when nothing is pending).
    """

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = ""
        self._time: float | None = None
        self._pending = False

    def feed_line(self, line: str, time: float | None = None) -> SSEEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if not self._pending:
            self._pending = True
            self._time = time
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._event = value
        # "id" and "retry" do not matter for one-shot completion streams.
        return None

    def finish(self) -> SSEEvent | None:
        """End of stream: a final event without its blank line still counts (lenient)."""
        return self._dispatch()

    def _dispatch(self) -> SSEEvent | None:
        event = None
        if self._data:
            event = SSEEvent("\n".join(self._data), self._event or "message", self._time)
        self._data, self._event, self._time, self._pending = [], "", None, False
        return event


def decode_sse_text(text: str) -> list[SSEEvent]:
    """Decode a whole event stream held in memory (for tests and offline parsing)."""
    decoder = SSEDecoder()
    events = [e for line in text.splitlines() if (e := decoder.feed_line(line)) is not None]
    last = decoder.finish()
    return [*events, last] if last is not None else events
