"""The Gomoku heuristic shared by the built-in opponent and the baseline agent: tuple scoring, incremental.

Every empty cell scores the sum, over the 4 directions and over every ``win_length`` window of cells
through it (no edge inside), of a value that depends on the stones already in the window:

- only the player's own stones, ``k`` of them: the value grows steeply as the window nears completion
  (``MINE``: completing the line is worth more than anything else);
- only the opponent's stones: blocking value (``THEIRS``: blocking a four beats everything but winning,
  blocking an open three beats building one's own three);
- no stones: a small value, so open central cells come first; both colors: 0 (the window is dead).

So the player wins when it can, blocks a four, makes its own four, blocks an open three, extends its
lines, in that order of priority, and prefers cells that serve several lines at once.

Speed. The scores live in one flat list (``ScoredGame.totals``), each entry
``score << 14 | jitter << 10 | cell``: a C-level ``max()`` gives the best cell in its low bits, ties broken
by a per-game random jitter. A move changes the scores of at most ``2 * (win_length - 1)`` empty cells on
each of the 4 lines through it; the change for one line is a memoised tuple looked up by the line's
``4 * win_length - 3`` cells around the move (one integer from the game's line encoding, see
:mod:`.game`) and added with a C-level ``map`` into a slice of the list. Occupied cells score
``OCCUPIED`` (far below any empty cell).
"""

from __future__ import annotations

from functools import lru_cache, cache
from operator import add

import numpy as np

from tinkergym_gomoku.game import BLACK, EDGE, EMPTY, WHITE, Game, win_table

SCORE_SHIFT = 14
JITTER_SHIFT = 10
CELL_MASK = (1 << JITTER_SHIFT) - 1
#: Score of an occupied cell, per direction.
OCCUPIED = -(1 << 46)
#: Value of a window holding only the player's stones, by stones still missing once this cell is played.
MINE = (100_000_000, 15_000, 800, 35)
#: Value of a window holding only the opponent's stones, by stones it still misses once it plays this cell.
THEIRS = (1_000_000, 2_500, 400, 15)
#: Value of a window with no stone at all.
OPEN = 7
#: Memoised deltas kept per table before the memo is cleared (bounds memory on long runs, ~20 MB).
DELTA_MEMO_LIMIT = 150_000


def window_value(cells: list[int], center: int, win_length: int, me: int) -> int:
    """The score (already shifted) of playing ``me`` at ``cells[center]``, counting only ``cells``.

    ``cells`` is one line segment reaching ``win_length - 1`` cells both sides of ``center``.
    """
    if cells[center] != EMPTY:
        return OCCUPIED
    total = 0
    top = len(MINE) - 1
    for start in range(center - win_length + 1, center + 1):
        window = cells[start : start + win_length]
        if EDGE in window:
            continue
        mine = window.count(me)
        theirs = window.count(3 - me)
        if mine and theirs:
            continue
        if mine:
            total += MINE[min(win_length - 1 - mine, top)]
        elif theirs:
            total += THEIRS[min(win_length - 1 - theirs, top)]
        else:
            total += OPEN
    return total << SCORE_SHIFT


def _decode(key: int, count: int) -> list[int]:
    return [(key >> (2 * i)) & 3 for i in range(count)]


class _ScoreTable(dict):
    """Window of ``2 * win_length - 1`` cells -> score of its centre for ``me`` (memoised)."""

    def __init__(self, win_length: int, me: int) -> None:
        super().__init__()
        self.win_length, self.me = win_length, me

    def __missing__(self, key: int) -> int:
        reach = self.win_length - 1
        value = window_value(_decode(key, 2 * reach + 1), reach, self.win_length, self.me)
        self[key] = value
        return value


class _DeltaTable(dict):
    """Segment of ``4 * win_length - 3`` cells around a stone just played -> the score changes it caused.

    The tuple holds one change per on-board cell within ``win_length - 1`` of the stone (the stone's own
    cell included), in line order: exactly the cells of the board slice in ``Geometry.score_slots``;
    then one more item, the stone's color if it completed a winning line on this line, else 0
    (``map`` over the slice stops before it).
    """

    def __init__(self, win_length: int, me: int) -> None:
        super().__init__()
        self.win_length, self.me = win_length, me
        self._interned: dict[tuple[int, ...], tuple[int, ...]] = {}

    def __missing__(self, key: int) -> tuple[int, ...]:
        reach = self.win_length - 1
        scores, mask = score_table(self.win_length, self.me), (1 << (2 * (2 * reach + 1))) - 1
        before = key & ~(3 << (4 * reach))
        changes = []
        for k in range(reach, 3 * reach + 1):
            if (key >> (2 * k)) & 3 == EDGE:
                continue
            shift = 2 * (k - reach)
            changes.append(scores[(key >> shift) & mask] - scores[(before >> shift) & mask])
        changes.append(win_table(self.win_length)[(key >> (2 * reach)) & mask])
        if len(self) >= DELTA_MEMO_LIMIT:
            self.clear()
            self._interned.clear()
        value = tuple(changes)
        value = self._interned.setdefault(value, value)
        self[key] = value
        return value


@cache
def score_table(win_length: int, me: int) -> _ScoreTable:
    """The shared memo of window scores for ``me``."""
    return _ScoreTable(win_length, me)


@cache
def delta_table(win_length: int, me: int) -> _DeltaTable:
    """The shared memo of score changes for ``me``."""
    return _DeltaTable(win_length, me)


def scores_from_lines(game: Game, me: int) -> list[int]:
    """Every cell's ``score << 14 | cell`` for ``me``, computed from scratch from ``game``'s lines."""
    geo, table = game.geo, score_table(game.win_length, me)
    totals = []
    for cell in range(geo.cells):
        total = cell
        for line, _bits, shift in geo.play_slots[1][cell]:
            total += table[(game.lines[line] >> shift) & geo.win_mask]
        totals.append(total)
    return totals


@lru_cache(maxsize=128)
def _empty_board_scores(size: int, win_length: int) -> np.ndarray:
    return np.array(scores_from_lines(Game(size, win_length), BLACK), dtype=np.int64)


class ScoredGame(Game):
    """A :class:`~tinkergym_gomoku.game.Game` that also keeps the heuristic score of every cell for ``me``.

    ``play`` updates the board, the lines, the win check and the scores in one pass over the 4 lines;
    :meth:`best` is the heuristic's move for ``me``.

    Args:
        size, win_length: As for :class:`~tinkergym_gomoku.game.Game`.
        me: The color the scores are for (``BLACK`` = X or ``WHITE`` = O).
        jitter: Random bytes (one per cell) that break ties between equal scores; ``None``: no jitter
            (ties go to the highest cell index).
    """

    def __init__(self, size: int, win_length: int, me: int, jitter: bytes | None = None) -> None:
        super().__init__(size, win_length)
        if me not in (BLACK, WHITE):
            raise ValueError(f"me must be {BLACK} (X) or {WHITE} (O), not {me!r}")
        self.me = me
        self._score_slots = self.geo.score_slots
        self._deltas = delta_table(win_length, me)
        self._segment_mask = (1 << (2 * (4 * win_length - 3))) - 1
        base = _empty_board_scores(size, win_length)
        if jitter is None:
            self.totals: list[int] = base.tolist()
        else:
            noise = np.frombuffer(jitter, dtype=np.uint8, count=self.geo.cells).astype(np.int64)
            self.totals = (base + ((noise & 15) << JITTER_SHIFT)).tolist()

    def play(self, cell: int, color: int) -> bool:
        """Put a ``color`` stone on ``cell`` and update the scores; return whether it wins."""
        self.board[cell] = color
        self.moves.append(cell)
        lines, totals, deltas, mask = self.lines, self.totals, self._deltas, self._segment_mask
        won = 0
        for line, bits, shift, cells in self._score_slots[color][cell]:
            value = lines[line] + bits
            lines[line] = value
            change = deltas[(value >> shift) & mask]
            totals[cells] = map(add, totals[cells], change)
            won |= change[-1]
        if won:
            self.winner = color
            return True
        return False

    def best(self) -> int:
        """The empty cell with the highest score for ``me`` (the board must not be full)."""
        return max(self.totals) & CELL_MASK

    def score(self, cell: int) -> int:
        """The heuristic score of ``cell`` for ``me`` (jitter and cell bits removed); negative when occupied."""
        return self.totals[cell] >> SCORE_SHIFT
