"""The baseline agent of both Gomoku envs: :class:`HeuristicAgent`."""

from __future__ import annotations

import hashlib
import os
import random
import re
from typing import Any

from tinkergym_gomoku.game import BLACK, COLUMN_LETTERS, MAX_SIZE, MIN_SIZE, MIN_WIN_LENGTH, WHITE, turn_tail
from tinkergym_gomoku.heuristic import ScoredGame

_ROW = re.compile(r"^ *(\d+) ([.XO](?: [.XO])*) \d+$", re.MULTILINE)
_TURN = re.compile(r"Move (\d+): your turn as ([XO]) \((\d+) in a row wins\)")
_SIZE = re.compile(r"on a (\d+)x\d+ board")
_OPPONENT = "Opponent played "


class HeuristicAgent:
    """Plays the :mod:`tinkergym_gomoku.heuristic` move, reading only the observation text.

    Works for ``tinker/Gomoku-v0`` and ``tinker/GomokuDuel-v0`` on any board size. On its first
    observation it reads the board (or, at the start of a game, just the board size from the opening
    line); then it adds its own last move and the ``"Opponent played J9."`` move to its record and
    updates its scores incrementally. Whenever its record disagrees with the observation's move number
    (e.g. feedback on a rejected move) it reads the whole board again. Its moves are always empty cells
    of the board it read.

    Args:
        seed: Seeds the tie-breaking between equally scored cells (``None``: random).
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._game: ScoredGame | None = None
        self._pending: int | None = None
        self._tail = ""

    def __call__(self, observation: str, info: dict[str, Any] | None = None) -> str:
        """The move to play, as a name such as ``"H8"``."""
        if not isinstance(observation, str):
            return "H8"
        game = self._game
        if game is None or not self._follow(game, observation):
            game = self._read(observation)
            if game is None:
                return "H8"
        cell = game.best()
        self._pending = cell
        return game.geo.labels[cell]

    def _follow(self, game: ScoredGame, observation: str) -> bool:
        """Add the agent's last move and the opponent's reply; whether the record matches the observation."""
        board = game.board
        pending, self._pending = self._pending, None
        if observation.startswith("Invalid action"):
            return False
        if pending is not None and not board[pending]:
            game.play(pending, game.me)
        start = observation.find(_OPPONENT)
        if start >= 0:
            start += 16
            cell = game.geo.moves.get(observation[start : observation.find(".", start)])
            if cell is not None and not board[cell]:
                game.play(cell, 3 - game.me)
        return observation.endswith(f"Move {len(game.moves) + 1}{self._tail}")

    def _read(self, observation: str) -> ScoredGame | None:
        """Start a record from the observation; ``None`` when it holds no turn line or board."""
        turn = _TURN.search(observation)
        if turn is None:
            return None
        number, me, win_length = int(turn.group(1)), BLACK if turn.group(2) == "X" else WHITE, int(turn.group(3))
        sized = _SIZE.search(observation)
        opponent = observation.find(_OPPONENT)
        if sized is not None and number <= 2 and (number == 1 or opponent >= 0):
            game = self._new_game(int(sized.group(1)), win_length, me)
            if game is not None and number == 2:
                start = opponent + 16
                cell = game.geo.moves.get(observation[start : observation.find(".", start)])
                if cell is None:
                    return self._read_rows(observation, win_length, me)
                game.play(cell, 3 - me)
            return game
        return self._read_rows(observation, win_length, me)

    def _read_rows(self, observation: str, win_length: int, me: int) -> ScoredGame | None:
        """Rebuild the record from the drawn board (rows ``"15 . . X ... 15"``)."""
        rows = _ROW.findall(observation)
        if not rows:
            return None
        size = len(rows[0][1].split())
        game = self._new_game(size, win_length, me)
        if game is None or len(rows) < size:
            return None
        for number, cells in rows[:size]:
            row = int(number)
            for col, mark in enumerate(cells.split()):
                if mark != "." and 1 <= row <= size and col < size:
                    game.play((row - 1) * size + col, BLACK if mark == "X" else WHITE)
        return None if game.is_full() else game

    def _new_game(self, size: int, win_length: int, me: int) -> ScoredGame | None:
        if not MIN_SIZE <= size <= MAX_SIZE or not MIN_WIN_LENGTH <= win_length <= size:
            return None
        cells = size * size
        if self._seed is None:
            jitter = os.urandom(cells)
        else:
            jitter = hashlib.shake_128(f"tinkergym-gomoku:{self._seed}".encode()).digest(cells)
        self._game = ScoredGame(size, win_length, me, jitter)
        self._tail = turn_tail(me, win_length)
        return self._game


class RandomMoveAgent:
    """Plays a uniformly random empty cell of the board drawn in the observation (a legal move, if one exists).

    The self-play league's ``random`` opponent: weak, but it plays the game instead of writing junk.

    Args:
        seed: Seeds the choice (``None``: random).
    """

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def __call__(self, observation: str, info: dict[str, Any] | None = None) -> str:
        """A random empty cell as a name such as ``"C5"``; ``"H8"`` when no board can be read."""
        rows = _ROW.findall(observation) if isinstance(observation, str) else []
        if not rows:
            return "H8"
        size = len(rows[0][1].split())
        empty = [f"{COLUMN_LETTERS[col]}{number}" for number, cells in rows[-size:] for col, mark in enumerate(cells.split()) if mark == "."]
        return self._rng.choice(sorted(empty)) if empty else "H8"


__all__ = ["HeuristicAgent", "RandomMoveAgent"]
