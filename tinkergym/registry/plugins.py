"""Plugins found through entry-point groups (trainers, backends): listed by name, loaded by name, an unknown name
answered with the close ones and every installed one. Metadata only until a plugin is loaded."""

from __future__ import annotations

import difflib
import importlib.metadata as md
from typing import Any

from tinkergym.errors import ConfigError


def available(group: str) -> dict[str, md.EntryPoint]:
    """The installed plugins of entry-point ``group`` by name."""
    return {ep.name: ep for ep in md.entry_points(group=group)}


def entry_point(group: str, name: str, what: str) -> md.EntryPoint:
    """Plugin ``name`` of ``group``, not loaded; :class:`ConfigError` naming the installed ``what``s when there is none."""
    found = available(group)
    if name not in found:
        close = difflib.get_close_matches(name, list(found), n=3)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown {what} {name!r}.{hint} Installed {what}s: {', '.join(sorted(found)) or 'none'}.")
    return found[name]


def load(group: str, name: str, what: str) -> Any:
    """The object plugin ``name`` of ``group`` points at (see :func:`entry_point`)."""
    return entry_point(group, name, what).load()
