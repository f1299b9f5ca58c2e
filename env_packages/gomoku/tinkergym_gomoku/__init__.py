"""tinkergym-gomoku: Gomoku (five in a row) as text environments.

- ``tinker/Gomoku-v0`` (:class:`GomokuEnv`): the agent against a built-in opponent.
- ``tinker/GomokuDuel-v0`` (:class:`GomokuDuelEnv`): two agents, PettingZoo AEC.
- :class:`HeuristicAgent`: the baseline agent for both.
"""

from tinkergym_gomoku.agents import HeuristicAgent
from tinkergym_gomoku.duel import GomokuDuelEnv
from tinkergym_gomoku.env import GomokuEnv

__all__ = ["GomokuDuelEnv", "GomokuEnv", "HeuristicAgent"]
