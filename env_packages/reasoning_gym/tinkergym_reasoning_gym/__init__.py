"""tinkergym-reasoning-gym: every reasoning-gym dataset as a single-turn text env, ``tinker/rg.<name>-v0``.

- :class:`~tinkergym_reasoning_gym.env.ReasoningGymEnv`: one reasoning-gym dataset (by name) as a text env,
  graded by the dataset's own scorer; ``tinkergym_reasoning_gym.datasets:<name>`` is its class for one dataset,
  the entry point of ``tinker/rg.<name>-v0``.
- :mod:`tinkergym_reasoning_gym.catalog`: the ids and their metadata, generated from reasoning-gym's registry.

Importing this package does not import reasoning-gym: making an env does.
"""

from tinkergym_reasoning_gym.agents import TaggedGuessAgent

__all__ = ["TaggedGuessAgent"]
