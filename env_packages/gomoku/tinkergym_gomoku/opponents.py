"""The built-in opponents of ``tinker/Gomoku-v0`` and the interface of a custom one.

A custom opponent is any callable ``opponent(state, rng) -> move``:

- ``state`` is a :class:`BoardState` (a read-only snapshot: size, win length, the grid, the side the
  opponent plays, the moves so far, and ``legal_moves()``);
- ``rng`` is the env's ``numpy.random.Generator`` (seeded by ``reset(seed=...)``);
- the return value is ``(row, col)`` with 1-based numbers (``row`` is the row number, ``col`` the column's
  number with ``A`` = 1; ``(8, 8)`` is ``H8``), or a move string such as ``"H8"``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

from tinkergym.errors import ConfigError, InvalidAction
from tinkergym_gomoku.game import EMPTY, SYMBOLS, Game
from tinkergym_gomoku.heuristic import ScoredGame

OpponentFn = Callable[["BoardState", Any], Any]


@dataclass(frozen=True)
class BoardState:
    """What a custom opponent sees.

    Attributes:
        size: Board side.
        win_length: Stones in a row that win.
        grid: ``grid[row - 1][col - 1]`` is ``"."``, ``"X"`` or ``"O"`` (row 1 first).
        player: The side the opponent plays, ``"X"`` or ``"O"``.
        moves: Every move so far in order, as names such as ``"H8"`` (X played the even indices).
    """

    size: int
    win_length: int
    grid: tuple[str, ...]
    player: str
    moves: tuple[str, ...]

    def legal_moves(self) -> list[tuple[int, int]]:
        """Every empty cell as ``(row, col)``, 1-based."""
        return [(r + 1, c + 1) for r, line in enumerate(self.grid) for c, ch in enumerate(line) if ch == "."]


class RandomOpponent:
    """Plays a uniformly random empty cell: the next empty cell of a random order of all cells drawn at reset."""

    def __init__(self, game: Game, rng: Any) -> None:
        self._board = game.board
        self._order = rng.permutation(game.geo.cells).tolist()
        self._next = 0

    def reply(self) -> int:
        """The next cell of the random order that is still empty (the board must not be full)."""
        board, order, i = self._board, self._order, self._next
        while board[order[i]] != EMPTY:
            i += 1
        self._next = i + 1
        return order[i]


class CallableOpponent:
    """Wraps a user callable ``fn(state, rng) -> (row, col) | "H8"`` (see the module docstring)."""

    def __init__(self, game: Game, color: int, rng: Any, fn: OpponentFn) -> None:
        self._game, self._color, self._rng, self._fn = game, color, rng, fn

    def reply(self) -> int:
        """Ask the callable; raise :class:`ConfigError` when it names no empty cell."""
        game = self._game
        n = game.size
        grid = tuple("".join(SYMBOLS[v] for v in game.board[r * n : (r + 1) * n]) for r in range(n))
        moves = tuple(game.geo.labels[c] for c in game.moves)
        state = BoardState(n, game.win_length, grid, SYMBOLS[self._color], moves)
        move = self._fn(state, self._rng)
        cell = self._to_cell(move)
        if cell is None or game.board[cell] != EMPTY:
            raise ConfigError(
                f"the opponent callable returned {move!r}, which is not an empty cell; "
                "it must return an empty cell as (row, col), 1-based, or a move name such as 'H8'."
            )
        return cell

    def _to_cell(self, move: Any) -> int | None:
        geo = self._game.geo
        if isinstance(move, str):
            try:
                return geo.parse_move(move)
            except InvalidAction:
                return None
        if isinstance(move, (tuple, list)) and len(move) == 2:
            try:
                return geo.cell_at(operator.index(move[0]), operator.index(move[1]))
            except TypeError:
                return None
        return None


def new_game(
    kind: str | OpponentFn, size: int, win_length: int, color: int, rng: Any
) -> tuple[Game, Callable[[], int]]:
    """A fresh game and the opponent's move function for ``kind`` (``"heuristic"``, ``"random"`` or a callable).

    The heuristic opponent keeps its scores inside the game (:class:`ScoredGame`), so every move played
    on the returned game, by either side, updates them.
    """
    if isinstance(kind, str) and kind == "heuristic":
        game = ScoredGame(size, win_length, color, rng.bytes(size * size))
        return game, game.best
    plain = Game(size, win_length)
    if isinstance(kind, str) and kind == "random":
        return plain, RandomOpponent(plain, rng).reply
    return plain, CallableOpponent(plain, color, rng, kind).reply  # type: ignore[arg-type]
