"""tinkergym-toytext: Gymnasium's toy-text envs as text envs, through :class:`tinkergym.adapters.DiscreteTextEnv`.

- ``tinker/FrozenLake-v0`` (:class:`FrozenLakeTextEnv`), ``tinker/Taxi-v0`` (:class:`TaxiTextEnv`),
  ``tinker/CliffWalking-v0`` (:class:`CliffWalkingTextEnv`), ``tinker/Blackjack-v0`` (:class:`BlackjackTextEnv`).
- :class:`RandomActionAgent`: plays one of the listed actions at random (the baseline and the random agent).
"""

from tinkergym_toytext.agents import RandomActionAgent
from tinkergym_toytext.envs import BlackjackTextEnv, CliffWalkingTextEnv, FrozenLakeTextEnv, TaxiTextEnv

__all__ = ["BlackjackTextEnv", "CliffWalkingTextEnv", "FrozenLakeTextEnv", "RandomActionAgent", "TaxiTextEnv"]
