"""``tinker/GomokuDuel-v0``: Gomoku between two agents, as a PettingZoo AEC :class:`~tinkergym.TextAECEnv`."""

from __future__ import annotations

from typing import Any

from tinkergym.aec import TextAECEnv
from tinkergym.errors import InvalidAction
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
    turn_text,
    validate_rules,
)


class GomokuDuelEnv(TextAECEnv):
    """Gomoku for two agents: ``player_0`` plays X and moves first, ``player_1`` plays O.

    Observation (per agent): text. On its turn an agent sees ``"Opponent played J9."`` (or, before its
    first move, a line naming the board, the goal and its side), the board, and
    ``"Move 5: your turn as X (5 in a row wins)."``. Off turn it sees ``"You played H8; waiting for the
    opponent."`` and the board. The board is drawn as in ``tinker/Gomoku-v0``: column letters ``A..``,
    row numbers ``1..size`` (row 1 at the bottom), ``.`` empty, ``X`` and ``O`` stones.

    Action: one move, ``H8`` / ``h8`` (column letter, row number) or ``8,8`` (ROW,COL: row number first,
    then the column number with A = 1); the LAST move-shaped token in the text is played.

    Reward: +1 to the winner and -1 to the loser; 0 to both for a draw (board full). A move that cannot
    be read, is off the board or on an occupied cell is rejected: ``invalid_action_penalty`` to the mover,
    who keeps the turn and sees what was wrong; ``max_invalid_actions`` rejected moves in a row forfeit
    the game (-1 to the mover, +1 to the other).

    Termination: a win, a full board or a forfeit ends the game for both agents. No truncation.

    Info: ``infos[agent]`` holds ``system_prompt`` (and ``error`` after a rejected move).

    Kwargs:
        size: Board side, 5 to 26 (default 15).
        win_length: Stones in a row that win, 3 to ``size`` (default 5).
        max_invalid_actions: Rejected moves in a row that forfeit (default 3, at least 1).
        invalid_action_penalty: Reward of a rejected move (default -0.1).
        render_mode: ``"ansi"`` (``render()`` returns the view of the agent to move), ``"human"`` or ``None``.

    Options: ``reset(options={"moves": ["H8", "H9", ...]})`` starts from those moves (played alternately
    from X; they must not end the game); the agent whose side is to move then starts.
    """

    metadata = {
        **TextAECEnv.metadata,
        "name": "gomoku_duel_v0",
        "tinkergym": {"data": "free", "turns": "multi", "agents": 2},
    }
    possible_agents = ["player_0", "player_1"]
    invalid_action_penalty = -0.1
    max_invalid_actions = 3
    forfeit_reward = -1.0

    def __init__(
        self,
        size: int = 15,
        win_length: int = 5,
        max_invalid_actions: int = 3,
        invalid_action_penalty: float = -0.1,
        render_mode: str | None = None,
    ) -> None:
        super().__init__(render_mode=render_mode)
        validate_rules(size, win_length, max_invalid_actions, invalid_action_penalty)
        self.size, self.win_length = size, win_length
        self.max_invalid_actions = max_invalid_actions
        self.invalid_action_penalty = float(invalid_action_penalty)
        self._geo = geometry(size, win_length)
        self.system_prompt = rules_text(self._geo, self.invalid_action_penalty, max_invalid_actions, in_a_row=True)
        self._game = Game(size, win_length)
        self._over = ""
        self._result: dict[str, float] = {}

    def _color(self, agent: str) -> int:
        """X for ``player_0``, O for ``player_1``."""
        return BLACK if agent == self.possible_agents[0] else WHITE

    def _reset_game(self, options: dict[str, Any]) -> str:
        self._game = Game(self.size, self.win_length)
        self._over, self._result = "", {}
        play_opening(self._game, options.get("moves", []))
        return self.possible_agents[0] if self._game.to_move == BLACK else self.possible_agents[1]

    def _observe(self, agent: str) -> str:
        game, color = self._game, self._color(agent)
        board = game.draw()
        if self._over:
            result = self._result.get(agent, 0.0)
            outcome = "You win." if result > 0 else "You lose." if result < 0 else "Draw."
            return f"{self._over} {outcome}\n\n{board}\n\nGame over (you were {SYMBOLS[color]})."
        if game.to_move != color:  # the last move, if any, was this agent's
            done = f"You played {game.last_label()}; waiting" if game.moves else "Waiting"
            return f"{done} for the opponent.\n\n{board}"
        played = game.moves[color - 1 :: 2]
        head = intro_text(self._geo, color) + " " if not played else ""
        if game.moves:
            head += f"Opponent played {game.last_label()}."
        return f"{head.rstrip()}\n\n{board}\n\n{turn_text(game, color)}"

    def _play(self, agent: str, action: str) -> dict[str, float] | None:
        geo, game, color = self._geo, self._game, self._color(agent)
        cell = geo.moves.get(action)
        if cell is None:
            cell = geo.parse_move(action)
        if game.board[cell]:
            raise InvalidAction(occupied_text(game, cell))
        other = self.possible_agents[1] if color == BLACK else self.possible_agents[0]
        if game.play(cell, color):
            self._over = f"{SYMBOLS[color]} ({agent}) played {geo.labels[cell]} and made {self.win_length} in a row."
            return self._finish({agent: 1.0, other: -1.0})
        if game.is_full():
            self._over = f"{SYMBOLS[color]} ({agent}) played {geo.labels[cell]}. The board is full: draw."
            return self._finish({agent: 0.0, other: 0.0})
        return None

    def _finish(self, rewards: dict[str, float]) -> dict[str, float]:
        """Remember the final rewards for the game-over view and return them."""
        self._result = rewards
        return rewards

    def invalid_action_hint(self, agent: str) -> str:
        """How to write a move (the board follows in the observation)."""
        return self._geo.move_help()

    def _forfeit_rewards(self, agent: str) -> dict[str, float]:
        """The base's forfeit rewards, remembered for the game-over view."""
        self._over = f"{agent} forfeited after {self.max_invalid_actions} rejected moves in a row."
        return self._finish(super()._forfeit_rewards(agent))
