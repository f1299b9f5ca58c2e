"""Text spaces that admit any printable text.

Gymnasium's :class:`~gymnasium.spaces.Text` defaults to an alphanumeric charset, which rejects spaces,
punctuation and every non-ASCII letter, so a board, a sentence or a tool call is "out of space".
:class:`PrintableText` keeps Gymnasium's class (``isinstance(space, spaces.Text)`` holds, so wrappers and
checkers treat it as text) but its ``contains`` admits any printable unicode plus newline, tab and
carriage return. Sampling draws from printable ASCII, which is what fuzzers and random agents need.

Vision-language envs observe :class:`TextWithImages`: a ``Dict`` of that text and a :class:`BoundedSequence`
of RGB ``uint8`` image arrays (numpy only; Pillow is the env's business, never imported here).
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

import numpy as np
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


class BoundedSequence(spaces.Sequence):
    """A :class:`gymnasium.spaces.Sequence` (unstacked: members are tuples) of at most ``max_length`` items.

    Gymnasium's ``Sequence`` has no bound on its length; an observation that a model reads needs one.
    :meth:`sample` draws the length uniformly from ``0..max_length`` unless a mask fixes it.
    """

    def __init__(self, feature_space: spaces.Space[Any], max_length: int, *, seed: Any = None) -> None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 0:
            raise ValueError(f"max_length={max_length!r}: choose a whole number of items, 0 or more.")
        super().__init__(feature_space, seed=seed, stack=False)
        self.max_length = max_length

    def sample(self, mask: Any = None, probability: Any = None) -> tuple[Any, ...]:
        """A tuple of up to ``max_length`` samples of the feature space."""
        if mask is None and probability is None:
            mask = (int(self.np_random.integers(0, self.max_length + 1)), None)
        result = super().sample(mask=mask, probability=probability)
        return tuple(result)

    def contains(self, x: Any) -> bool:
        """Return whether ``x`` is a tuple of at most ``max_length`` members of the feature space."""
        return isinstance(x, tuple) and len(x) <= self.max_length and super().contains(x)

    def __repr__(self) -> str:
        return f"BoundedSequence({self.feature_space}, max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BoundedSequence) and self.max_length == other.max_length and self.feature_space == other.feature_space

    __hash__ = None  # type: ignore[assignment]


def image_box(height: int, width: int) -> spaces.Box:
    """The space of one RGB image of ``height`` x ``width`` pixels: ``Box(0, 255, (H, W, 3), uint8)``."""
    return spaces.Box(0, 255, (height, width, 3), np.uint8)


class TextWithImages(spaces.Dict):
    """Observations of vision-language envs: ``{"text": str, "images": (array, ...)}``.

    ``text`` is a :class:`PrintableText`; ``images`` a :class:`BoundedSequence` of at most ``max_images``
    RGB images, each a ``uint8`` array of shape ``(height, width, 3)`` (an env documents its image size;
    a model's processor resizes as it needs). The images are those shown with this observation, in the
    order they appear before the text (see :func:`tinkergym.chat.observation_message`); a text-only
    turn has ``images == ()``. Gymnasium's own tools (``check_env``, ``data_equivalence``,
    ``flatten_space`` aside) treat it as the ``Dict`` it is.

    Args:
        max_length: Longest ``text``, in characters.
        image_shape: ``(height, width)`` of every image.
        max_images: Most images in one observation.
        seed: Seed for :meth:`sample`.
    """

    def __init__(self, max_length: int = DEFAULT_MAX_LENGTH, *, image_shape: tuple[int, int] = (256, 256), max_images: int = 1, seed: Any = None) -> None:
        height, width = image_shape
        super().__init__({"text": PrintableText(max_length), "images": BoundedSequence(image_box(height, width), max_images)}, seed=seed)
        self.max_length = max_length
        self.image_shape = (int(height), int(width))
        self.max_images = max_images

    def __repr__(self) -> str:
        return f"TextWithImages(max_length={self.max_length}, image_shape={self.image_shape}, max_images={self.max_images})"


def text_with_images(text: str, images: Any = ()) -> dict[str, Any]:
    """An observation of a :class:`TextWithImages` space: ``text`` and a fresh tuple of copied images."""
    return {"text": text, "images": tuple(np.array(image, dtype=np.uint8, copy=True) for image in images)}


def observation_text(observation: Any) -> str:
    """The text of an observation: a ``str`` itself, or the ``"text"`` of a :class:`TextWithImages` member."""
    if isinstance(observation, Mapping):
        return str(observation.get("text", ""))
    return observation if isinstance(observation, str) else str(observation)
