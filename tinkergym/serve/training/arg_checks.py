"""The checks of a training call's JSON arguments that :func:`~tinkergym.serve.training.calls.parse_call` builds on.

:func:`checked` holds a value to its type annotation (JSON types only: nothing a client sends is unpickled or
executed), :func:`from_json` rebuilds a protocol dataclass from its JSON object with every field so checked,
:func:`check_token_ids` bounds token ids by the vocabulary, and :func:`scoring_images` checks a ``logprobs`` call's
images. Each problem is a :class:`~tinkergym.errors.ConfigError` that names the argument.
"""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Protocol

from tinkergym.errors import ConfigError
from tinkergym.protocol.types import MAX_IMAGES, ImageData


def json_type_error(where: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(f"{where}: expected {expected}, got {type(value).__name__} {str(value)[:60]!r}")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def checked(value: Any, hint: Any, where: str) -> Any:
    """``value`` checked against the annotation ``hint`` (JSON types only); ints become floats where floats go."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors: list[ConfigError] = []
        for option in typing.get_args(hint):
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return checked(value, option, where)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0] if len(errors) == 1 else ConfigError(f"{where}: {str(value)[:60]!r} fits none of {hint}")
    if origin is list:
        if not isinstance(value, list):
            raise json_type_error(where, "a list", value)
        (item,) = typing.get_args(hint)
        # Token ids and per-token floats are most of a request: one pass over them, the per-item walk only on a miss.
        if item is int and all(type(v) is int for v in value):
            return value
        if item is float and all(type(v) is float for v in value):
            return value
        return [checked(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise json_type_error(where, "an object", value)
        _, item = typing.get_args(hint)
        return {str(k): checked(v, item, f"{where}.{k}") for k, v in value.items()}
    if isinstance(hint, type) and is_dataclass(hint):  # hints are classes, never dataclass instances
        if not isinstance(value, hint):
            raise json_type_error(where, f"a {hint.__name__} object", value)
        hints = _type_hints(hint)
        for f in fields(hint):
            setattr(value, f.name, checked(getattr(value, f.name), hints[f.name], f"{where}.{f.name}"))
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise json_type_error(where, "true or false", value)
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise json_type_error(where, "an integer", value)
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise json_type_error(where, "a number", value)
        try:
            return float(value)
        except OverflowError:  # an integer past a float's range (JSON integers have no bound)
            raise ConfigError(f"{where}: {str(value)[:24]}... is too large for a number (at most about 1.8e308)") from None
    if hint is str:
        if not isinstance(value, str):
            raise json_type_error(where, "a string", value)
        return value
    raise ConfigError(f"{where}: unsupported type {hint}")


class _FromDict(Protocol):
    """A protocol dataclass: rebuilt from its JSON object by ``from_dict``."""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any: ...


def from_json(cls: type[_FromDict], data: Any, where: str) -> Any:
    """``cls.from_dict(data)`` with every field's JSON type checked; any problem is a :class:`ConfigError`."""
    if not isinstance(data, dict):
        raise json_type_error(where, f"a {cls.__name__} object", data)
    try:
        value = cls.from_dict(data)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return checked(value, cls, where)


def check_token_ids(rows: list[list[int]], vocab_size: int | None, where: str) -> None:
    """Every row holds a token and every id is in ``[0, vocab_size)``: an empty row has nothing to run the model on,
    an id out of range would index past the embedding (on a GPU, a device assert)."""
    for i, row in enumerate(rows):
        if not row:
            raise ConfigError(f"{where}[{i}] has no tokens: every sequence needs at least one")
        for token in row:
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ConfigError(f"{where}[{i}]: token id {token} is outside the vocabulary [0, {vocab_size})")


def scoring_images(value: Any, sequences: int) -> list[list[ImageData]]:
    """A ``logprobs`` call's images: one list per sequence of at most :data:`MAX_IMAGES` images, each checked as
    :class:`ImageData` is (size, pixel bound, base64 length) and its base64 decoded once here, so bad bytes are this
    call's 400 and never reach a pass that other sessions share."""
    rows = checked(value, list[list[Any]], "args.images")
    if len(rows) != sequences:
        raise ConfigError(f"args.images must hold one list per sequence ({sequences}), not {len(rows)}")
    images: list[list[ImageData]] = []
    for i, row in enumerate(rows):
        if len(row) > MAX_IMAGES:
            raise ConfigError(f"args.images[{i}] carries {len(row)} images; at most {MAX_IMAGES} are allowed")
        row_images = [from_json(ImageData, image, f"args.images[{i}][{j}]") for j, image in enumerate(row)]
        for j, image in enumerate(row_images):
            try:
                image.pixels()
            except ValueError as exc:
                raise ConfigError(f"args.images[{i}][{j}]: {exc}") from exc
        images.append(row_images)
    return images
