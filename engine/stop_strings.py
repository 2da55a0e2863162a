"""A request's stop strings, indexed once and shared by all its sequences.

``StopStrings`` is immutable: a request's choices (and its sampling parameters' copies) hold the
same object, so adding a sequence copies nothing and builds nothing. Its index answers "which stop
string ends at this position of the text" in time that depends on the distinct lengths of the
stop strings ending in that character, not on how many stop strings there are: the engine thread
runs this for every sequence on every token.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any


class StopStrings:
    """Stop strings in the client's order (the first listed wins a tie), non-empty.

    Invariants: ``strings`` never changes; ``max_len`` is the longest one's length (0 when
    there are none); ``_rank`` maps each distinct string to its first position in ``strings``;
    ``_lengths[c]`` lists the distinct lengths of the strings whose last character is ``c``.
    """

    __slots__ = ("strings", "max_len", "_rank", "_lengths")

    strings: tuple[str, ...]
    max_len: int
    _rank: dict[str, int]
    _lengths: dict[str, tuple[int, ...]]

    def __init__(self, strings: Iterable[str] = ()) -> None:
        items = tuple(strings)
        if any(not isinstance(s, str) or not s for s in items):
            raise ValueError("stop: every stop string must be a non-empty string")
        rank: dict[str, int] = {}
        lengths: dict[str, set[int]] = {}
        for i, s in enumerate(items):
            rank.setdefault(s, i)
            lengths.setdefault(s[-1], set()).add(len(s))
        object.__setattr__(self, "strings", items)
        object.__setattr__(self, "max_len", max(map(len, items), default=0))
        object.__setattr__(self, "_rank", rank)
        object.__setattr__(self, "_lengths", {c: tuple(sorted(ls)) for c, ls in lengths.items()})

    @classmethod
    def of(cls, stop: StopStrings | Iterable[str] | str | None) -> StopStrings:
        """``stop`` itself when it already is one (shared, not copied)."""
        if isinstance(stop, StopStrings):
            return stop
        if stop is None:
            return EMPTY
        return cls([stop] if isinstance(stop, str) else stop)

    def find(self, text: str, start: int, first_end: int) -> tuple[int, str] | None:
        """The earliest stop string in ``text`` that begins at ``start`` or later and ends after
        ``first_end`` (earlier ends were searched already): ``(index, string)``, the first
        listed one when several begin at the same index; None when there is none.

        The caller guarantees that no stop string begins at ``start`` or later and ends at or
        before ``first_end``, so this finds what ``min(text.find(s, start) for s in strings)``
        would, looking only at the new ends.
        """
        best: tuple[int, int] | None = None  # (index, rank)
        lengths, rank = self._lengths, self._rank
        for end in range(max(first_end, start) + 1, len(text) + 1):
            for n in lengths.get(text[end - 1], ()):
                idx = end - n
                if idx < start:
                    break  # lengths are ascending: longer ones begin earlier still
                r = rank.get(text[idx:end])
                if r is not None and (best is None or (idx, r) < best):
                    best = (idx, r)
        if best is None:
            return None
        return best[0], self.strings[best[1]]

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("StopStrings is immutable")

    def __reduce__(self) -> tuple[type[StopStrings], tuple[tuple[str, ...]]]:
        # Only the strings cross a process boundary; the index is rebuilt once on arrival.
        return StopStrings, (self.strings,)

    def __iter__(self) -> Iterator[str]:
        return iter(self.strings)

    def __len__(self) -> int:
        return len(self.strings)

    def __bool__(self) -> bool:
        return bool(self.strings)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StopStrings):
            return self.strings == other.strings
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.strings)

    def __repr__(self) -> str:
        return f"StopStrings({list(self.strings)!r})"


EMPTY = StopStrings()
