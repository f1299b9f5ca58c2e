"""One env class per TextArena game, made on first use: ``games.ta_TicTacToe_v0`` is the env of ``tinker/ta.TicTacToe-v0``.

Entry points name a module attribute (``tinkergym_textarena.games:ta_TicTacToe_v0``); this module makes it when it is
first asked for (PEP 562): a :class:`~tinkergym_textarena.env.TextArenaEnv` for a single-player game, a
:class:`~tinkergym_textarena.env.TextArenaDuelEnv` for a two-player one, as the generated ``tinkergym_envs.toml`` says.
"""

from __future__ import annotations

import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

from tinkergym_textarena.env import TextArenaDuelEnv, TextArenaEnv

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

_ATTRIBUTE = re.compile(r"^ta_(?P<game>\w+?)_v(?P<version>\d+)$")


@lru_cache(maxsize=1)
def manifest() -> dict[str, Any]:
    """The generated metadata of every id this package offers."""
    return tomllib.loads((Path(__file__).parent / "tinkergym_envs.toml").read_text(encoding="utf-8"))


def __getattr__(name: str) -> Any:
    match = _ATTRIBUTE.match(name)
    table = manifest().get(f"tinker/ta.{match['game']}-v{match['version']}") if match else None
    if match is None or table is None:
        raise AttributeError(f"tinkergym_textarena.games has no game {name!r}")
    base = TextArenaEnv if table["kind"] == "env" else TextArenaDuelEnv
    metadata = dict(base.metadata)
    if base is TextArenaDuelEnv:
        metadata["name"] = f"textarena_{match['game'].lower()}_v{match['version']}"
    doc = f"``tinker/ta.{match['game']}-v{match['version']}``: {table['summary']} Variants: {', '.join(table['variants']) or 'none'}.\n\n"
    cls = type(name, (base,), {"game": match["game"], "version": match["version"], "metadata": metadata,
                                "needs_nltk": tuple(table.get("needs_nltk", ())),
                                "__doc__": doc + (base.__doc__ or ""), "__module__": __name__})
    cls.__qualname__ = name
    globals()[name] = cls
    return cls
