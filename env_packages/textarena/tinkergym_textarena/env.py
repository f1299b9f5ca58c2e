"""TextArena games as tinkergym envs: single-player ones as a Gymnasium :class:`TextArenaEnv`, two-player ones as a
PettingZoo AEC :class:`TextArenaDuelEnv` (what self-play trains on)."""

from __future__ import annotations

import inspect
import math
from typing import Any, ClassVar

from tinkergym import TextEnv
from tinkergym.aec import TextAECEnv
from tinkergym.core import StepResult
from tinkergym.errors import ConfigError, InvalidAction

from tinkergym_textarena.match import Match

_RULES = """
Observation: TextArena's messages since your last move, one per line, ``[GAME] ...`` from the game and
``[Player 1] ...`` from the other player: first the game's rules and the form of a move, then the board or
state after each move. When the game ends: the last messages and TextArena's reason.
Action: a move in the form the game asks for, e.g. ``[4]`` or ``[e2e4]``; where TextArena's default adds the
brackets, a move without any (``e2e4``) gets them.
Invalid moves: where TextArena rejects a move (its reason is the feedback), the player pays
``invalid_action_penalty`` (-0.1), keeps the turn and tries again; ``max_invalid_actions`` (3) of them{streak}
end the game: {forfeit}. TextArena's own limit (a loss at the second invalid move in a row) is lifted.
Seeds: a seeded reset plays the same game (TextArena's randomness is kept per env).

Kwargs: ``variant`` (one of TextArena's registered variants of the game, e.g. ``"hard"``; ``None``: its
default), ``invalid_action_penalty``, ``max_invalid_actions``, ``forfeit_reward``, ``render_mode``, and any
keyword argument of TextArena's game class (they override the variant's).
"""


def _start(env: Any, variant: str | None, penalty: float, max_invalid: int, forfeit: float, kwargs: dict[str, Any], kind: str) -> None:
    """The rules (checked) and the match of a TextArena env of either kind; its system prompt says ``kind`` of game."""
    for name, value in (("invalid_action_penalty", penalty), ("forfeit_reward", forfeit)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{name}={value!r}: choose a finite number.")
    if isinstance(max_invalid, bool) or not isinstance(max_invalid, int) or max_invalid < 1:
        raise ConfigError(f"max_invalid_actions={max_invalid!r}: choose a whole number of at least 1.")
    env.invalid_action_penalty, env.forfeit_reward, env.max_invalid_actions = float(penalty), float(forfeit), max_invalid
    env.match = Match(f"tinker/ta.{env.game}-v{env.version}", env.game, env.version, variant, kwargs, env.needs_nltk)
    env.system_prompt = (
        f"You are playing {env.game}, {kind}. The game's messages give its rules, the state and the form of a move (most moves "
        "go in square brackets, e.g. [3]). Reply with your move."
    )


class TextArenaEnv(TextEnv):
    """A single-player TextArena game as a Gymnasium text env.

    Reward: TextArena's reward when the game ends (1 for a solved puzzle; many games give the fraction done,
    some a score), 0 before; ``info["is_success"]``: a final reward of 1 or more.
    Termination: when TextArena ends the game (a solve, a loss, its turn limit).
    """

    __doc__ = inspect.cleandoc(__doc__ or "") + "\n" + _RULES.format(streak=" in an episode", forfeit="its last one scores ``forfeit_reward`` (-1)")
    game: ClassVar[str] = ""
    version: ClassVar[str] = "0"
    needs_nltk: ClassVar[tuple[str, ...]] = ()
    match: Match  # the game in play (set by _start)
    metadata = {**TextEnv.metadata, "tinkergym": {"data": "free", "turns": "multi", "agents": 1}}
    max_action_length = 4_096

    def __init__(
        self,
        variant: str | None = None,
        invalid_action_penalty: float = -0.1,
        max_invalid_actions: int = 3,
        forfeit_reward: float = -1.0,
        render_mode: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(render_mode=render_mode)
        _start(self, variant, invalid_action_penalty, max_invalid_actions, forfeit_reward, kwargs, "a single-player TextArena game")

    def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.match.reset(1, int(self.np_random.integers(2**31 - 1)))
        return self.match.take(0) or "Your move.", {"textarena_id": self.match.ta_id}

    def _step(self, action: str) -> StepResult:
        reason = self.match.play(action)
        if reason is not None:
            raise InvalidAction(reason)
        if not self.match.done:
            return self.match.take(0) or "Your move.", 0.0, False, False, {}
        reward = self.match.rewards()[0]
        text = "\n".join(t for t in (self.match.take(0), f"Game over: {self.match.outcome(0)}") if t)
        return text, reward, True, False, {"is_success": reward >= 1.0, "textarena_reward": reward}

    def invalid_action_hint(self) -> str:
        """The messages the rejected move brought (often the board again)."""
        return self.match.take(0) or "Reply with a move in the form the game asks for."


class TextArenaDuelEnv(TextAECEnv):
    """A two-player TextArena game as a PettingZoo AEC text env: ``player_0`` is TextArena's player 0.

    Reward: TextArena's at the end of the game (+1 the winner, -1 the loser, 0 both for a draw); 0 before.
    Termination: when TextArena ends the game (a win, a draw, its turn limit), for both players.
    Turns: TextArena's; the player to move is ``agent_selection``.
    """

    __doc__ = inspect.cleandoc(__doc__ or "") + "\n" + _RULES.format(streak=" in a row", forfeit="-1 to that player (``forfeit_reward``), +1 to the other")
    game: ClassVar[str] = ""
    version: ClassVar[str] = "0"
    needs_nltk: ClassVar[tuple[str, ...]] = ()
    match: Match  # the game in play (set by _start)
    metadata = {**TextAECEnv.metadata, "name": "textarena_duel_v0", "tinkergym": {"data": "free", "turns": "multi", "agents": 2}}
    possible_agents = ["player_0", "player_1"]
    max_action_length = 4_096

    def __init__(
        self,
        variant: str | None = None,
        invalid_action_penalty: float = -0.1,
        max_invalid_actions: int = 3,
        forfeit_reward: float = -1.0,
        render_mode: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(render_mode=render_mode)
        _start(self, variant, invalid_action_penalty, max_invalid_actions, forfeit_reward, kwargs, "a two-player TextArena game, against another player")
        self._final: dict[str, float] = {}
        self._forfeit = ""

    @staticmethod
    def _player(agent: str) -> int:
        return int(agent.rsplit("_", 1)[1])

    def _reset_game(self, options: dict[str, Any]) -> str:
        self._final, self._forfeit = {}, ""
        self.match.reset(2, int(self.np_random.integers(2**31 - 1)))
        return f"player_{self.match.current}"

    def _observe(self, agent: str) -> str:
        player = self._player(agent)
        news = self.match.peek(player)
        if self._final:
            result = self._final.get(agent, 0.0)
            verdict = "You win." if result > 0 else "You lose." if result < 0 else "Draw."
            return "\n".join(t for t in (news, f"Game over: {self._forfeit or self.match.outcome(player)} {verdict}") if t)
        if self.match.current != player:
            return news or "Waiting for the other player."
        return news or "Your move."

    def _play(self, agent: str, action: str) -> dict[str, float] | None:
        reason = self.match.play(action)
        if reason is not None:
            raise InvalidAction(reason)
        if not self.match.done:
            return None
        self._final = {f"player_{pid}": reward for pid, reward in self.match.rewards().items()}
        return dict(self._final)

    def _next_agent(self, agent: str) -> str:
        return f"player_{self.match.current}"

    def _forfeit_rewards(self, agent: str) -> dict[str, float]:
        self._forfeit = f"{agent} forfeited after {self.max_invalid_actions} invalid moves in a row."
        self._final = super()._forfeit_rewards(agent)
        return dict(self._final)

    def invalid_action_hint(self, agent: str) -> str:
        """What a valid move looks like (the game's messages follow in the observation)."""
        return "Reply with a move in the form the game asks for."
