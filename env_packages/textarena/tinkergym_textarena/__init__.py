"""tinkergym-textarena: TextArena's games as tinkergym envs, ``tinker/ta.<Game>-v0``.

- Single-player games: :class:`~tinkergym_textarena.env.TextArenaEnv` (Gymnasium); two-player games:
  :class:`~tinkergym_textarena.env.TextArenaDuelEnv` (PettingZoo AEC, what self-play trains on).
- :mod:`tinkergym_textarena.catalog`: the ids and their metadata, generated from TextArena's registry.
- :class:`BracketMoveAgent`: a random player of the moves the game lists.

Importing this package does not import TextArena: making an env does.
"""

from tinkergym_textarena.agents import BracketMoveAgent

__all__ = ["BracketMoveAgent"]
