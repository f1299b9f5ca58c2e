"""Shared pieces of the CLI commands: id lookup with usage errors, ``--kwarg`` parsing."""

from __future__ import annotations

import json
from typing import Any

import click

from tinkergym.errors import TinkergymError
from tinkergym.registry import EnvSpec, spec


def lookup(env_id: str) -> EnvSpec:
    """The spec of ``env_id``, or a usage error (exit code 2) with suggestions."""
    try:
        return spec(env_id)
    except TinkergymError as exc:
        raise click.UsageError(str(exc)) from exc


def parse_kwargs(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``("size=7", "opponent=random")`` -> ``{"size": 7, "opponent": "random"}`` (values read as JSON when they parse)."""
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.isidentifier():
            raise click.BadParameter(f"{pair!r}: expected KEY=VALUE, e.g. size=7", param_hint="--kwarg")
        try:
            kwargs[key] = json.loads(raw)
        except json.JSONDecodeError:
            kwargs[key] = raw
    return kwargs


def env_ids_argument(required: bool = False):
    """A variadic ENV_ID argument."""
    return click.argument("env_ids", nargs=-1, required=required, metavar="ENV_ID...")
