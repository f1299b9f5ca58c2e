"""The Gomoku game shared by both envs and the baseline agent: board, move notation, win check, text board.

Coordinates. A board of ``size`` columns and rows; columns are letters ``A``, ``B``, ... (``I`` included)
and rows are numbers ``1..size``, row 1 at the bottom of the drawing. A move is written ``H8`` (column
letter, then row number; case does not matter) or ``8,8`` (``ROW,COL``: row number first, then the column's
number with ``A`` = 1, so ``3,8`` is ``H3``). Internally a cell is the flat index ``(row - 1) * size + (col - 1)``.

Speed. Every line of the board (rows, columns and both diagonals) is kept as one integer with two bits per
cell (0 empty, 1 X, 2 O, 3 beyond the edge) and ``2 * (win_length - 1)`` edge cells of padding at each end.
A move adds its stone to the four lines through it, and the win check looks up the window of
``2 * win_length - 1`` cells centred on the move in a memoised table: only lines through the last move are
examined, and the check is four dictionary lookups. The board drawing is kept as one ASCII buffer in
which only the cells played since the last drawing are rewritten.
"""

from __future__ import annotations

import math
import re
import string
from functools import lru_cache, cache
from typing import Any

from tinkergym.errors import ConfigError, InvalidAction
from tinkergym.spaces import describe_text

EMPTY, BLACK, WHITE, EDGE = 0, 1, 2, 3
#: Board symbols by cell value; ``BLACK`` is X (moves first), ``WHITE`` is O.
SYMBOLS = (".", "X", "O")
_SYMBOL_CODES = tuple(ord(s) for s in SYMBOLS)
COLUMN_LETTERS = string.ascii_uppercase
MIN_SIZE, MAX_SIZE = 5, 26
MIN_WIN_LENGTH = 3

_MOVE_TOKEN = re.compile(
    r"(?<![A-Za-z0-9])([A-Za-z])(\d{1,3})(?!\d)"  # H8: a letter that does not end a word, then a row number
    r"|(?<!\d)(\d{1,3})\s*,\s*(\d{1,3})(?!\d)",  # 8,8: ROW,COL
    re.ASCII,
)


class Geometry:
    """Everything about a ``size`` x ``size`` board and a ``win_length`` that does not change during a game.

    Built once per (size, win_length) by :func:`geometry` and shared by every game on such a board.

    Attributes:
        size, win_length, cells: board side, stones in a row to win, ``size * size``.
        labels: the ``H8``-style name of every cell.
        moves: exact move strings (``H8``, ``h8``, ``8,8``) to cells: the fast path of :meth:`parse_move`.
        line_init: the integer of every empty line (edge padding set).
        win_mask: mask of the ``2 * win_length - 1`` cell window the win check looks up.
        play_slots: ``play_slots[color][cell]`` = ``((line, stone_bits, window_shift), ...)`` for the 4 lines.
        score_slots: ``score_slots[color][cell]`` = ``((line, stone_bits, segment_shift, board_slice), ...)``:
            the same 4 lines for :class:`~tinkergym_gomoku.heuristic.ScoredGame`, with the shift of the
            ``4 * win_length - 3`` cell segment around the cell and the board cells within
            ``win_length - 1`` of it on that line.
        empty_drawing: the drawing of the empty board; ``offset[cell]``: where the cell's symbol sits in it.
    """

    def __init__(self, size: int, win_length: int) -> None:
        self.size, self.win_length, self.cells = size, win_length, size * size
        self.reach = win_length - 1
        self.pad = 2 * self.reach
        self.win_mask = (1 << (2 * (2 * self.reach + 1))) - 1
        self.labels = tuple(f"{COLUMN_LETTERS[c % size]}{c // size + 1}" for c in range(self.cells))
        self.moves: dict[str, int] = {}
        for cell, label in enumerate(self.labels):
            row, col = cell // size + 1, cell % size + 1
            for text in (label, label.lower(), f"{row},{col}", f"{row}, {col}"):
                self.moves[text] = cell
        self.lines = self._lines()
        self.line_init = tuple(self._empty_line(len(line)) for line in self.lines)
        self.play_slots, self.score_slots = self._slots()
        self._init_drawing()

    def _lines(self) -> list[tuple[int, ...]]:
        """Every row, column, diagonal and anti-diagonal, as cells in increasing flat index."""
        n = self.size
        rows = [tuple(r * n + c for c in range(n)) for r in range(n)]
        cols = [tuple(r * n + c for r in range(n)) for c in range(n)]
        diag_starts = [(0, c) for c in range(n)] + [(r, 0) for r in range(1, n)]
        diags = [tuple((r + k) * n + c + k for k in range(min(n - r, n - c))) for r, c in diag_starts]
        anti_starts = [(0, c) for c in range(n)] + [(r, n - 1) for r in range(1, n)]
        antis = [tuple((r + k) * n + c - k for k in range(min(n - r, c + 1))) for r, c in anti_starts]
        return rows + cols + diags + antis

    def _empty_line(self, length: int) -> int:
        value = 0
        for i in range(self.pad):
            value |= EDGE << (2 * i)
            value |= EDGE << (2 * (self.pad + length + i))
        return value

    def _slots(self) -> tuple[Any, Any]:
        play: list[list[tuple[int, int, int]]] = [[] for _ in range(self.cells)]
        score: list[list[tuple[int, int, int, slice]]] = [[] for _ in range(self.cells)]
        for index, line in enumerate(self.lines):
            step = line[1] - line[0] if len(line) > 1 else 1
            for pos, cell in enumerate(line):
                play[cell].append((index, 2 * (pos + self.pad), 2 * (pos + self.reach)))
                first, last = line[max(0, pos - self.reach)], line[min(len(line) - 1, pos + self.reach)]
                score[cell].append((index, 2 * (pos + self.pad), 2 * pos, slice(first, last + 1, step)))
        play_by_color = tuple(
            tuple(tuple((li, color << bit, shift) for li, bit, shift in slots) for slots in play) for color in (0, 1, 2)
        )
        score_by_color = tuple(
            tuple(tuple((li, color << bit, shift, cells) for li, bit, shift, cells in slots) for slots in score)
            for color in (0, 1, 2)
        )
        return play_by_color, score_by_color

    def _init_drawing(self) -> None:
        n = self.size
        width = len(str(n))
        letters = " ".join(COLUMN_LETTERS[:n])
        edge = " " * (width + 1) + letters
        lines = [edge] + [f"{r:>{width}} " + " ".join("." * n) + f" {r}" for r in range(n, 0, -1)] + [edge]
        self.empty_drawing = "\n".join(lines)
        starts = [sum(len(line) + 1 for line in lines[:i]) for i in range(len(lines))]
        self.offset = tuple(starts[n - cell // n] + width + 1 + 2 * (cell % n) for cell in range(self.cells))

    def cell_at(self, row: int, col: int) -> int | None:
        """The cell at 1-based ``row`` (number) and ``col`` (A = 1), or ``None`` when off the board."""
        if 1 <= row <= self.size and 1 <= col <= self.size:
            return (row - 1) * self.size + col - 1
        return None

    def parse_move(self, text: str) -> int:
        """The cell named by ``text`` (see the module docstring), or raise :class:`InvalidAction`.

        Surrounding words are tolerated: the LAST move-shaped token in the text is the move
        (``"I considered A1, but my move: H8"`` plays H8).
        """
        cell = self.moves.get(text)
        if cell is not None:
            return cell
        cell = self.moves.get(text.strip())
        if cell is not None:
            return cell
        matches = list(_MOVE_TOKEN.finditer(text))
        match = matches[-1] if matches else None  # the last move named
        if match is None:
            raise InvalidAction(f"no move found in {describe_text(text)}.")
        letter, number, row_text, col_text = match.groups()
        if letter is not None:
            row, col = int(number), COLUMN_LETTERS.index(letter.upper()) + 1
        else:
            row, col = int(row_text), int(col_text)
        cell = self.cell_at(row, col)
        if cell is None:
            last = COLUMN_LETTERS[self.size - 1]
            raise InvalidAction(f"{match.group(0)!r} is off the board (columns A-{last}, rows 1-{self.size}).")
        return cell

    def move_help(self) -> str:
        """One sentence on the move formats for this board."""
        last = COLUMN_LETTERS[self.size - 1]
        center = self.labels[(self.size // 2) * self.size + self.size // 2]
        return (
            f"Name an empty cell as column letter A-{last} then row number 1-{self.size} (like {center}), "
            f"or as ROW,COL numbers (like {self.size // 2 + 1},{self.size // 2 + 1})."
        )


@lru_cache(maxsize=64)
def geometry(size: int, win_length: int) -> Geometry:
    """The shared :class:`Geometry` of a board (memoised)."""
    return Geometry(size, win_length)


class _WinTable(dict):
    """Window of ``2 * win_length - 1`` cells (centre just played) -> the centre's color if it completes a line."""

    def __init__(self, win_length: int) -> None:
        super().__init__()
        self.win_length = win_length
        self.reach = win_length - 1

    def __missing__(self, key: int) -> int:
        cells = [(key >> (2 * i)) & 3 for i in range(2 * self.reach + 1)]
        color = cells[self.reach]
        run = 1
        i = self.reach - 1
        while i >= 0 and cells[i] == color:
            run, i = run + 1, i - 1
        i = self.reach + 1
        while i < len(cells) and cells[i] == color:
            run, i = run + 1, i + 1
        winner = color if color in (BLACK, WHITE) and run >= self.win_length else 0
        self[key] = winner
        return winner


@cache
def win_table(win_length: int) -> _WinTable:
    """The memoised win table of ``win_length`` (shared by every game)."""
    return _WinTable(win_length)


class Game:
    """One Gomoku game: the board, the line integers, the move list and a lazily updated drawing.

    ``play`` does not check whose turn it is or whether the cell is empty; callers check
    :meth:`is_empty` first (the envs turn an occupied cell into an invalid action).
    """

    def __init__(self, size: int, win_length: int) -> None:
        self.geo = geometry(size, win_length)
        self.size, self.win_length = size, win_length
        self.board = [EMPTY] * self.geo.cells
        self.lines = list(self.geo.line_init)
        self.moves: list[int] = []
        self.winner = 0
        self._drawing = bytearray(self.geo.empty_drawing, "ascii")
        self._drawn = 0
        self._text = self.geo.empty_drawing
        self._wins = win_table(win_length)

    @property
    def to_move(self) -> int:
        """The color whose turn it is (X after an even number of moves)."""
        return BLACK if len(self.moves) % 2 == 0 else WHITE

    def is_empty(self, cell: int) -> bool:
        """Whether ``cell`` holds no stone."""
        return self.board[cell] == EMPTY

    def is_full(self) -> bool:
        """Whether every cell holds a stone."""
        return len(self.moves) == self.geo.cells

    def play(self, cell: int, color: int) -> bool:
        """Put a ``color`` stone on ``cell``; return whether it completes ``win_length`` (or more) in a row."""
        self.board[cell] = color
        self.moves.append(cell)
        lines, wins, mask, won = self.lines, self._wins, self.geo.win_mask, False
        for line, bits, shift in self.geo.play_slots[color][cell]:
            value = lines[line] + bits
            lines[line] = value
            if wins[(value >> shift) & mask]:
                won = True
        if won:
            self.winner = color
        return won

    def draw(self) -> str:
        """The board as text: column letters above and below, row numbers at both ends, row 1 at the bottom.

        The drawing is kept between calls; only the cells played since the last call are redrawn.
        """
        moves = self.moves
        if self._drawn < len(moves):
            drawing, offset, board = self._drawing, self.geo.offset, self.board
            for cell in moves[self._drawn :]:
                drawing[offset[cell]] = _SYMBOL_CODES[board[cell]]
            self._drawn = len(moves)
            self._text = drawing.decode("ascii")
        return self._text

    def last_label(self) -> str | None:
        """The name of the last move, if any."""
        return self.geo.labels[self.moves[-1]] if self.moves else None


def play_opening(game: Game, moves: Any) -> None:
    """Play ``moves`` (a list of move strings) alternately from X; raise :class:`ConfigError` when one is bad."""
    if not isinstance(moves, (list, tuple)) or not all(isinstance(m, str) for m in moves):
        raise ConfigError("options['moves'] must be a list of move strings such as ['H8', 'H9'].")
    for text in moves:
        try:
            cell = game.geo.parse_move(text)
        except InvalidAction as exc:
            raise ConfigError(f"options['moves']: {exc}") from None
        if not game.is_empty(cell):
            raise ConfigError(f"options['moves']: {game.geo.labels[cell]} is played twice.")
        if game.play(cell, game.to_move) or game.is_full():
            raise ConfigError("options['moves'] must not finish the game; leave at least one move to play.")


def rules_text(geo: Geometry, penalty: float, limit: int, in_a_row: bool) -> str:
    """The system prompt body shared by both envs: rules, board drawing, move formats, rewards."""
    n, last = geo.size, COLUMN_LETTERS[geo.size - 1]
    mid = n // 2 + 1
    center = geo.labels[(mid - 1) * n + mid - 1]
    if in_a_row:
        limit_text = f"{limit} rejected moves in a row lose"
    else:
        limit_text = f"the {_ordinal(limit)} rejected move of a game loses"
    return (
        f"You are playing Gomoku on a {n}x{n} board. Players take turns putting one stone on an empty cell; "
        f"X moves first, O second. The first player with {geo.win_length} or more stones in an unbroken line "
        "(across, down or diagonally) wins; if the board fills up first, the game is a draw.\n\n"
        f"The board is drawn with columns lettered A-{last} from left to right and rows numbered 1-{n} from "
        "bottom to top; '.' is an empty cell.\n\n"
        f"Answer with one move: the column letter then the row number, like {center} (the center; case does "
        f"not matter), or ROW,COL as two numbers with the row number first and the column number second "
        f"(A=1), like {mid},{mid} for {center}. If your answer names several moves, the last one is played.\n\n"
        f"Rewards: +1 for a win, -1 for a loss, 0 for a draw. A move that cannot be read, is off the board or "
        f"is on an occupied cell is rejected with a reward of {penalty:g} and you play again; "
        f"{limit_text} the game (reward -1)."
    )


def _ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def intro_text(geo: Geometry, color: int) -> str:
    """The first line a player sees: board, goal and its side."""
    side = "X and you move first" if color == BLACK else "O and X moves first"
    return f"New game of Gomoku on a {geo.size}x{geo.size} board: {geo.win_length} in a row wins. You are {side}."


def occupied_text(game: Game, cell: int) -> str:
    """The rejection message for a move on an occupied cell."""
    return f"{game.geo.labels[cell]} is already taken by {SYMBOLS[game.board[cell]]}; pick an empty cell ('.')."


def turn_tail(color: int, win_length: int) -> str:
    """The turn line after its move number: ``": your turn as X (5 in a row wins)."``."""
    return f": your turn as {SYMBOLS[color]} ({win_length} in a row wins)."


def turn_text(game: Game, color: int) -> str:
    """The closing line of an observation when ``color`` is to move (the baseline agent reads it)."""
    return f"Move {len(game.moves) + 1}{turn_tail(color, game.win_length)}"


def validate_rules(size: Any, win_length: Any, max_invalid_actions: Any, invalid_action_penalty: Any) -> None:
    """Raise :class:`ConfigError` (saying what to pass instead) for a bad kwarg shared by both envs."""

    def is_int(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not is_int(size) or not MIN_SIZE <= size <= MAX_SIZE:
        raise ConfigError(f"size={size!r}: pass an int from {MIN_SIZE} to {MAX_SIZE} (columns are letters A-Z).")
    if not is_int(win_length) or not MIN_WIN_LENGTH <= win_length <= size:
        raise ConfigError(f"win_length={win_length!r}: pass an int from {MIN_WIN_LENGTH} to the board size ({size}).")
    if not is_int(max_invalid_actions) or max_invalid_actions < 1:
        raise ConfigError(f"max_invalid_actions={max_invalid_actions!r}: pass an int >= 1 (every game must end).")
    penalty = invalid_action_penalty
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty):
        raise ConfigError(f"invalid_action_penalty={invalid_action_penalty!r}: pass a finite number such as -0.1.")
