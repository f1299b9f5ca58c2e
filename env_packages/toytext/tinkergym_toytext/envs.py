"""Gymnasium's toy-text envs as text envs: each is a :class:`~tinkergym.adapters.DiscreteTextEnv` over the
Gymnasium env of the same name, with action names a model can type and the state written out in text.

Every env keeps Gymnasium's rules, rewards and kwargs (passed through to ``gym.make``). A bad action (no
action named, several, not text) costs the env's ``invalid_action_penalty`` and the game does not move; the
``max_invalid_actions``-th (default 3) ends the episode with ``forfeit_reward``, what the game's worst move costs.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from tinkergym.adapters import DiscreteTextEnv, plain_text
from tinkergym.errors import ConfigError


def _make(env_id: str, render_mode: str | None, kwargs: dict[str, Any]) -> gym.Env:
    """``gym.make(env_id, ...)`` with Gymnasium's own errors for a bad kwarg as :class:`ConfigError`."""
    try:
        return gym.make(env_id, render_mode=render_mode, **kwargs)
    except (TypeError, ValueError, KeyError, gym.error.Error) as exc:
        raise ConfigError(f"{env_id}: {exc}. The kwargs are Gymnasium's for {env_id}.") from exc


class _ToyTextEnv(DiscreteTextEnv):
    """What the four envs share: the Gymnasium id to wrap, the rules kwargs and the kwargs passed through."""

    gym_id = ""
    render_inner: str | None = "ansi"

    def __init__(
        self,
        invalid_action_penalty: float | None = None,
        max_invalid_actions: int | None = None,
        forfeit_reward: float | None = None,
        render_mode: str | None = None,
        **gym_kwargs: Any,
    ) -> None:
        self.gym_kwargs = gym_kwargs
        super().__init__(
            invalid_action_penalty=invalid_action_penalty, max_invalid_actions=max_invalid_actions,
            forfeit_reward=forfeit_reward, render_mode=render_mode,
        )

    def make_env(self) -> gym.Env:
        """The Gymnasium env this text env plays."""
        return _make(self.gym_id, self.render_inner, self.gym_kwargs)


class FrozenLakeTextEnv(_ToyTextEnv):
    """Gymnasium's ``FrozenLake-v1`` in text: walk from S to G over frozen tiles (F) without falling into a hole (H).

    Observation: the map, one row per line (row 1 at the top), ``@`` where you stand; a line with your row and
    column; the actions. After a step it is led by ``"down: reward 0."``.
    Action: ``left``, ``down``, ``right`` or ``up`` (action 0 to 3). On a slippery lake (Gymnasium's default) a
    move may slide sideways.
    Reward: 1 on reaching G, else 0. Falling into a hole or reaching G ends the episode (``is_success``: the goal).
    Bad action: -0.1, the game does not move; the third in an episode ends it with -1.
    Truncation: after 100 steps (Gymnasium's ``FrozenLake-v1`` limit; the hub's spec counts bad actions too).

    Kwargs: Gymnasium's ``map_name`` (``"4x4"``, ``"8x8"``), ``desc``, ``is_slippery``, ``success_rate``,
    ``reward_schedule``; and ``invalid_action_penalty``, ``max_invalid_actions``, ``forfeit_reward``, ``render_mode``.
    """

    gym_id = "FrozenLake-v1"
    render_inner = None
    action_names = ("left", "down", "right", "up")
    invalid_action_penalty = -0.1
    forfeit_reward = -1.0
    system_prompt = (
        "You walk on a frozen lake drawn as a grid: S is the start, F frozen ice, H a hole, G the goal, and @ is you. "
        "Reach G without stepping into a hole; the ice may be slippery. Each turn, answer with one move: left, down, right or up."
    )

    def describe(self, observation: Any, info: dict[str, Any]) -> str:
        lake = self.env.unwrapped
        rows = [[c.decode() for c in row] for row in lake.desc.tolist()]
        row, col = divmod(int(lake.s), lake.ncol)
        tile = {"S": "the start", "F": "frozen ice", "H": "a hole", "G": "the goal"}[rows[row][col]]
        rows[row][col] = "@"
        grid = "\n".join("".join(r) for r in rows)
        return f"{grid}\n\nYou (@) are on {tile} at row {row + 1}, column {col + 1} of {lake.nrow}x{lake.ncol}."

    def success(self, reward: float, terminated: bool, truncated: bool, info: dict[str, Any]) -> bool | None:
        return terminated and reward > 0


class TaxiTextEnv(_ToyTextEnv):
    """Gymnasium's ``Taxi-v4`` in text: drive to the passenger, pick them up, drop them off at the destination.

    Observation: Gymnasium's map (``|`` walls, ``:`` open passages; the stands R, G, Y, B) with ``T`` for the
    taxi, and lines saying where the taxi is, where the passenger is and where they go; the actions.
    Action: ``south``, ``north``, ``east``, ``west``, ``pickup`` or ``dropoff`` (action 0 to 5); ``pick up`` and
    ``drop off`` work too. ``info["legal_actions"]`` lists the actions that change the state (Gymnasium's mask).
    Reward: -1 per step, +20 for delivering the passenger (which ends the episode; ``is_success``), -10 for a
    pickup or drop-off in the wrong place.
    Bad action: -1, the taxi does not move; the third in an episode ends it with -10.
    Truncation: after 200 steps (Gymnasium's limit).

    Kwargs: Gymnasium's ``is_rainy``, ``fickle_passenger``, ``rainy_probability``, ``fickle_probability``;
    and ``invalid_action_penalty``, ``max_invalid_actions``, ``forfeit_reward``, ``render_mode``.
    """

    gym_id = "Taxi-v4"
    action_names = ("south", "north", "east", "west", "pickup", "dropoff")
    action_aliases = {"pick up": "pickup", "drop off": "dropoff"}
    invalid_action_penalty = -1.0
    forfeit_reward = -10.0
    system_prompt = (
        "You drive a taxi (T) on a 5x5 map with four stands, R, G, Y and B; | is a wall, : an open passage. Drive to the "
        "passenger, pick them up, and drop them off at their destination. Each step costs 1 point, a delivery earns 20 and "
        "a pickup or drop-off in the wrong place costs 10. Each turn, answer with one action: south, north, east, west, "
        "pickup or dropoff."
    )
    _STANDS = ("R", "G", "Y", "B")

    def describe(self, observation: Any, info: dict[str, Any]) -> str:
        taxi = self.env.unwrapped
        row, col, passenger, destination = taxi.decode(int(taxi.s))
        lines = plain_text(taxi.render()).rstrip("\n").split("\n")
        grid = [list(line) for line in lines[: len(taxi.desc)]]
        grid[1 + row][2 * col + 1] = "T"
        at = next((f" at stand {s}" for s, loc in zip(self._STANDS, taxi.locs) if loc == (row, col)), "")
        rider = "is in the taxi" if passenger == 4 else f"waits at stand {self._STANDS[passenger]}"
        return (
            "\n".join("".join(r) for r in grid)
            + f"\n\nThe taxi (T) is at row {row + 1}, column {col + 1}{at}. The passenger {rider} "
            f"and wants to go to stand {self._STANDS[destination]}."
        )

    def success(self, reward: float, terminated: bool, truncated: bool, info: dict[str, Any]) -> bool | None:
        return terminated


class CliffWalkingTextEnv(_ToyTextEnv):
    """Gymnasium's ``CliffWalking-v1`` in text: walk from the bottom-left corner to the bottom-right one along a cliff.

    Observation: Gymnasium's ``ansi`` rendering (``x`` you, ``o`` open ground, ``C`` the cliff, ``T`` the
    target; row 1 at the top), a line with your row and column, and the actions.
    Action: ``up``, ``right``, ``down`` or ``left`` (action 0 to 3).
    Reward: -1 per step; stepping onto the cliff costs -100 and sends you back to the start. Reaching the target
    ends the episode (``is_success``).
    Bad action: -1, you do not move; the third in an episode ends it with -100.
    Truncation: after 200 steps (the hub's spec; Gymnasium sets none).

    Kwargs: Gymnasium's ``is_slippery``; and ``invalid_action_penalty``, ``max_invalid_actions``,
    ``forfeit_reward``, ``render_mode``.
    """

    gym_id = "CliffWalking-v1"
    action_names = ("up", "right", "down", "left")
    invalid_action_penalty = -1.0
    forfeit_reward = -100.0
    system_prompt = (
        "You walk on a 4x12 grid: x is you, o open ground, C the cliff and T the target. Reach T; each step costs 1 point "
        "and stepping onto the cliff costs 100 and sends you back to the start. Each turn, answer with one move: up, right, "
        "down or left."
    )

    def describe(self, observation: Any, info: dict[str, Any]) -> str:
        walk = self.env.unwrapped
        row, col = divmod(int(walk.s), walk.shape[1])
        board = plain_text(walk.render()).rstrip("\n")
        return f"{board}\n\nYou (x) are at row {row + 1}, column {col + 1} of {walk.shape[0]}x{walk.shape[1]}."

    def success(self, reward: float, terminated: bool, truncated: bool, info: dict[str, Any]) -> bool | None:
        return terminated


def _cards(hand: list[int]) -> str:
    return ", ".join("A" if card == 1 else str(card) for card in hand)


class BlackjackTextEnv(_ToyTextEnv):
    """Gymnasium's ``Blackjack-v1`` with a text table of our own: hit or stick against the dealer.

    Observation: your cards (``A`` an ace, 10 for any ten or face card), their total and whether an ace counts
    11, and the dealer's face-up card; once the hand is over, the dealer's whole hand and the outcome.
    Action: ``hit`` (take a card) or ``stick`` (stop; ``stand`` works too), action 1 and 0.
    Reward: +1 for a win, -1 for a loss, 0 for a draw, at the end of the hand (Gymnasium's rules: Sutton and
    Barto's by default; ``natural=True`` pays 1.5 for a natural blackjack). ``is_success``: a win.
    Bad action: -0.1, no card is dealt; the third in a hand ends it with -1.

    Kwargs: Gymnasium's ``natural``, ``sab``; and ``invalid_action_penalty``, ``max_invalid_actions``,
    ``forfeit_reward``, ``render_mode``.
    """

    gym_id = "Blackjack-v1"
    render_inner = None
    action_names = ("stick", "hit")
    action_aliases = {"stand": "stick"}
    invalid_action_penalty = -0.1
    forfeit_reward = -1.0
    _last_action = ""
    system_prompt = (
        "You play one hand of blackjack against the dealer. Cards 2-10 count their value, face cards 10, an ace 1 or 11. "
        "Get closer to 21 than the dealer without going over. Each turn, answer hit (take another card) or stick (stop)."
    )

    def describe(self, observation: Any, info: dict[str, Any]) -> str:
        table = self.env.unwrapped
        total, dealer_card, usable_ace = (int(v) for v in observation)
        ace = " (an ace counts 11)" if usable_ace else ""
        yours = f"Your cards: {_cards(table.player)}, total {total}{ace}."
        if not self._hand_over(total):
            return f"{yours}\nThe dealer shows: {_cards([dealer_card])}."
        dealer = sum(table.dealer) + (10 if 1 in table.dealer and sum(table.dealer) + 10 <= 21 else 0)
        return f"{yours}\nThe dealer's cards: {_cards(table.dealer)}, total {dealer}."

    def _hand_over(self, total: int) -> bool:
        return total > 21 or self._last_action == "stick"

    def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self._last_action = ""
        return super()._reset(options)

    def parse_action(self, text: str) -> int:
        index = super().parse_action(text)
        self._last_action = self.names[index]
        return index

    def success(self, reward: float, terminated: bool, truncated: bool, info: dict[str, Any]) -> bool | None:
        return terminated and reward > 0
