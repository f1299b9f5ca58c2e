"""Text spaces that admit any printable text.

Gymnasium's :class:`~gymnasium.spaces.Text` defaults to an alphanumeric charset, which rejects spaces,
punctuation and every non-ASCII letter, so a board, a sentence or a tool call is "out of space".
:class:`PrintableText` keeps Gymnasium's class (``isinstance(space, spaces.Text)`` holds, so wrappers and
checkers treat it as text) but its ``contains`` admits any printable unicode plus newline, tab and
carriage return. Sampling draws from printable ASCII, which is what fuzzers and random agents need.
"""

from __future__ import annotations

import string
from typing import Any

from gymnasium import spaces

#: Characters :meth:`PrintableText.sample` draws from: printable ASCII, whitespace included.
SAMPLE_CHARSET = string.printable.replace("\x0b", "").replace("\x0c", "")
#: Whitespace that counts as printable in text observations and actions.
_ALLOWED_WHITESPACE = str.maketrans("", "", "\n\t\r")

DEFAULT_MAX_LENGTH = 16_384


def is_printable_text(text: str) -> bool:
    """Whether every character of ``text`` is printable unicode, newline, tab or carriage return."""
    return text.translate(_ALLOWED_WHITESPACE).isprintable()


class PrintableText(spaces.Text):
    """A :class:`gymnasium.spaces.Text` whose members are printable unicode strings of bounded length.

    Args:
        max_length: Longest member, in characters (documented by each env).
        min_length: Shortest member, in characters (0: the empty string is a member).
        seed: Seed for :meth:`sample`.
    """

    def __init__(self, max_length: int = DEFAULT_MAX_LENGTH, *, min_length: int = 0, seed: Any = None):
        super().__init__(max_length, min_length=min_length, charset=SAMPLE_CHARSET, seed=seed)

    def contains(self, x: Any) -> bool:
        """Return whether ``x`` is a printable string within the length bounds."""
        return isinstance(x, str) and self.min_length <= len(x) <= self.max_length and is_printable_text(x)

    def __repr__(self) -> str:
        return f"PrintableText({self.min_length}, {self.max_length})"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, PrintableText)
            and self.min_length == other.min_length
            and self.max_length == other.max_length
        )

    __hash__ = None  # type: ignore[assignment]  # mutable seeding state, like Gymnasium spaces


def describe_text(text: Any, limit: int = 80) -> str:
    """A short, printable rendering of an arbitrary (possibly hostile) action for feedback messages."""
    if not isinstance(text, str):
        return f"<{type(text).__name__}>"
    shown = text if len(text) <= limit else text[:limit] + "..."
    if is_printable_text(shown):
        return repr(shown)
    return ascii(shown)
