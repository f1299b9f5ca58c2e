"""``tinker/Gomoku-v0``: Gomoku against a built-in opponent, as a single-agent :class:`~tinkergym.TextEnv`."""

from __future__ import annotations

from typing import Any

from tinkergym.core import StepResult, TextEnv
from tinkergym.errors import ConfigError, InvalidAction
from tinkergym_gomoku.game import (
    BLACK,
    SYMBOLS,
    WHITE,
    Game,
    geometry,
    intro_text,
    occupied_text,
    play_opening,
    rules_text,
    turn_tail,
    turn_text,
    validate_rules,
)
from tinkergym_gomoku.opponents import new_game


class GomokuEnv(TextEnv):
    """Gomoku (five in a row) against a built-in opponent.

    Observation: text. After reset, a line naming the board, the goal and the agent's side, then the
    board; after each move, ``"You played H8. Opponent played J9."`` then the board, then
    ``"Move 5: your turn as X (5 in a row wins)."``. The board has column letters ``A..`` above and below,
    row numbers ``1..size`` at both ends (row 1 at the bottom), ``.`` empty, ``X`` and ``O`` stones.

    Action: one move, ``H8`` / ``h8`` (column letter, row number) or ``8,8`` (ROW,COL: row number first,
    then the column number with A = 1). Surrounding text is allowed; the LAST move-shaped token is played.

    Reward: +1 win, -1 loss, 0 draw (board full), 0 for a move that does not end the game. A move that
    cannot be read, is off the board or on an occupied cell is rejected: reward ``invalid_action_penalty``
    and the agent plays again (the feedback repeats the board); the ``max_invalid_actions``-th rejected
    move of an episode ends it with -1.

    Termination: a win, a loss, a full board, or the last allowed rejected move. No truncation (a game
    lasts at most ``ceil(size**2 / 2) + max_invalid_actions - 1`` steps).

    Info: reset has ``system_prompt``, ``you`` (``"X"``/``"O"``), ``size``, ``win_length``, ``moves``;
    a step has ``move``, ``opponent_move`` (names or ``None``), ``moves`` (stones on the board) and
    ``winner`` (``"X"``, ``"O"``, ``"draw"`` or ``None``), ``is_success`` (whether the agent won).

    Kwargs:
        size: Board side, 5 to 26 (default 15).
        win_length: Stones in a row that win, 3 to ``size`` (default 5).
        opponent: ``"heuristic"`` (default: wins when it can, blocks fours and open threes, builds its
            lines), ``"random"`` (uniform empty cell) or a callable ``fn(state, rng) -> (row, col) | "H8"``
            (see :mod:`tinkergym_gomoku.opponents`).
        agent_first: The agent plays X and moves first (default ``True``); else the opponent does.
        max_invalid_actions: Rejected moves per episode before it is lost (default 3, at least 1).
        invalid_action_penalty: Reward of a rejected move (default -0.1).
        render_mode: ``"ansi"`` (``render()`` returns the latest observation), ``"human"`` or ``None``.

    Options: ``reset(options={"moves": ["H8", "H9", ...]})`` starts from those moves (played alternately
    from X; they must not end the game). If the opponent is then to move, it replies before the first
    observation.
    """

    metadata = {**TextEnv.metadata, "tinkergym": {"data": "free", "turns": "multi", "agents": 1}}
    invalid_action_penalty = -0.1
    max_invalid_actions = 3
    forfeit_reward = -1.0

    def __init__(
        self,
        size: int = 15,
        win_length: int = 5,
        opponent: Any = "heuristic",
        agent_first: bool = True,
        max_invalid_actions: int = 3,
        invalid_action_penalty: float = -0.1,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(render_mode=render_mode)
        validate_rules(size, win_length, max_invalid_actions, invalid_action_penalty)
        if not (callable(opponent) or (isinstance(opponent, str) and opponent in ("heuristic", "random"))):
            raise ConfigError(
                f"opponent={opponent!r}: pass 'heuristic', 'random' or a callable fn(state, rng) -> (row, col)."
            )
        if not isinstance(agent_first, bool):
            raise ConfigError(f"agent_first={agent_first!r}: pass True (the agent plays X) or False (it plays O).")
        self.size, self.win_length, self.opponent = size, win_length, opponent
        self.agent_first = agent_first
        self.max_invalid_actions = max_invalid_actions
        self.invalid_action_penalty = float(invalid_action_penalty)
        self._geo = geometry(size, win_length)
        self._me = BLACK if agent_first else WHITE
        self._them = WHITE if agent_first else BLACK
        self._turn_tail = turn_tail(self._me, win_length)
        self.system_prompt = rules_text(self._geo, self.invalid_action_penalty, max_invalid_actions, in_a_row=False)
        self._game = Game(size, win_length)

    def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        game, self._reply = new_game(self.opponent, self.size, self.win_length, self._them, self.np_random)
        self._game = game
        play_opening(game, options.get("moves", []))
        head = intro_text(self._geo, self._me)
        if game.to_move == self._them:
            cell = self._reply()
            if game.play(cell, self._them) or game.is_full():
                raise ConfigError("options['moves']: the opponent's first reply ends the game; use another position.")
            head += f" Opponent played {self._geo.labels[cell]}."
        info = {"you": SYMBOLS[self._me], "size": self.size, "win_length": self.win_length, "moves": len(game.moves)}
        return f"{head}\n\n{game.draw()}\n\n{turn_text(game, self._me)}", info

    def _step(self, action: str) -> StepResult:
        geo, game = self._geo, self._game
        cell = geo.moves.get(action)
        if cell is None:
            cell = geo.parse_move(action)
        if game.board[cell]:
            raise InvalidAction(occupied_text(game, cell))
        mine = geo.labels[cell]
        if game.play(cell, self._me):
            return self._end(f"You played {mine} and made {self.win_length} in a row. You win!", 1.0, mine, None)
        if len(game.moves) == geo.cells:
            return self._end(f"You played {mine}. The board is full: draw.", 0.0, mine, None)
        reply = self._reply()
        theirs = geo.labels[reply]
        if game.play(reply, self._them):
            text = f"You played {mine}. Opponent played {theirs} and made {self.win_length} in a row. You lose."
            return self._end(text, -1.0, mine, theirs)
        if len(game.moves) == geo.cells:
            text = f"You played {mine}. Opponent played {theirs}. The board is full: draw."
            return self._end(text, 0.0, mine, theirs)
        info = {"move": mine, "opponent_move": theirs, "moves": len(game.moves), "winner": None, "is_success": False}
        board, number = game.draw(), len(game.moves) + 1
        text = f"You played {mine}. Opponent played {theirs}.\n\n{board}\n\nMove {number}{self._turn_tail}"
        return text, 0.0, False, False, info

    def _end(self, text: str, reward: float, mine: str, theirs: str | None) -> StepResult:
        game = self._game
        winner = SYMBOLS[game.winner] if game.winner else "draw"
        info = {"move": mine, "opponent_move": theirs, "moves": len(game.moves), "winner": winner, "is_success": reward > 0}
        return f"{text}\n\n{game.draw()}\n\nGame over.", reward, True, False, info

    def invalid_action_hint(self) -> str:
        """How to write a move, then the board and whose turn it is (so the feedback stands on its own)."""
        game = self._game
        return f"{self._geo.move_help()}\n\n{game.draw()}\n\n{turn_text(game, self._me)}"
