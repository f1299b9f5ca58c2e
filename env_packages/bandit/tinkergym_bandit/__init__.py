"""tinkergym-bandit: ``tinker/Bandit-v0``, a k-armed bandit described in text."""

from tinkergym_bandit.agents import RandomArmAgent
from tinkergym_bandit.env import ARM_NAMES, BanditEnv

__all__ = ["ARM_NAMES", "BanditEnv", "RandomArmAgent"]
