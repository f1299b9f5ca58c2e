"""``tinker/Bandit-v0``: pick one of k arms; the payout is sampled from hidden odds."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from tinkergym import TextEnv
from tinkergym.core import StepResult
from tinkergym.errors import ConfigError, InvalidAction
from tinkergym.spaces import describe_text

#: Arm names, in the order arms are created (the listing order is shuffled every episode).
ARM_NAMES = ("red", "blue", "green", "yellow", "purple", "orange", "white", "black", "silver", "gold", "pink", "brown")
_WORD = re.compile(r"[a-z]+")


class BanditEnv(TextEnv):
    """A k-armed bandit told in words: the agent names one arm and is paid 1 with that arm's hidden odds.

    Observation: a short text listing the k arms (by colour name, in a seeded random order each episode).
    Action: the name of one arm, e.g. ``red``; case and surrounding words are ignored as long as exactly
    one arm name appears ("I pull the red arm" works; "red or blue" does not).
    Reward: 1 with the chosen arm's hidden probability, else 0 (``reward_mode="expected"`` pays the
    probability itself: a noise-free signal). A bad action (no arm, several arms, not text) ends the episode
    with ``invalid_action_penalty`` (-0.1).
    Termination: after the single step (single-turn). Never truncated.

    Args:
        arms: Number of arms k (2 to 12; default 5).
        payoff_seed: Seed of the hidden payout probabilities. With the default 0 they are fixed across
            episodes, so the best arm is something to learn; ``None`` draws new odds from each reset's seed.
        reward_mode: ``"sample"`` (Bernoulli payout, default) or ``"expected"`` (the probability).
        render_mode: ``"ansi"``, ``"human"`` or ``None``.
    """

    metadata = {**TextEnv.metadata, "tinkergym": {"data": "free", "turns": "single", "agents": 1}}
    invalid_action_penalty = -0.1
    max_invalid_actions = 1
    max_action_length = 4_096
    max_observation_length = 2_048

    def __init__(self, arms: int = 5, payoff_seed: int | None = 0, reward_mode: str = "sample", render_mode: str | None = None) -> None:
        super().__init__(render_mode=render_mode)
        if not isinstance(arms, int) or not 2 <= arms <= len(ARM_NAMES):
            raise ConfigError(f"arms={arms!r}: choose an integer from 2 to {len(ARM_NAMES)}.")
        if payoff_seed is not None and (isinstance(payoff_seed, bool) or not isinstance(payoff_seed, int) or payoff_seed < 0):
            raise ConfigError(f"payoff_seed={payoff_seed!r}: use a whole number 0 or more (fixed odds), or None (new odds every episode).")
        if reward_mode not in ("sample", "expected"):
            raise ConfigError(f"reward_mode={reward_mode!r}: use 'sample' or 'expected'.")
        self.arm_names = ARM_NAMES[:arms]
        self.payoff_seed = payoff_seed
        self.reward_mode = reward_mode
        self.probabilities = self._draw_odds(np.random.default_rng(payoff_seed)) if payoff_seed is not None else None
        self._order: list[str] = list(self.arm_names)

    def _draw_odds(self, rng: np.random.Generator) -> dict[str, float]:
        odds = rng.uniform(0.05, 0.95, size=len(self.arm_names)).round(3)
        return dict(zip(self.arm_names, (float(p) for p in odds)))

    def get_system_prompt(self) -> str:
        return (
            "You are playing a row of slot machines. Each machine has a lever (an arm) with its own hidden chance of "
            "paying out 1 point. Choose one arm. Answer with the arm's colour name only, for example: "
            f"{self.arm_names[0]}"
        )

    def _reset(self, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        if self.payoff_seed is None:
            self.probabilities = self._draw_odds(self.np_random)
        self._order = [self.arm_names[i] for i in self.np_random.permutation(len(self.arm_names))]
        listing = "\n".join(f"- the {name} arm" for name in self._order)
        observation = f"There are {len(self._order)} arms:\n{listing}\nWhich arm do you pull?"
        return observation, {"arms": list(self._order)}

    def _parse(self, action: str) -> str:
        named = {w for w in _WORD.findall(action.lower()) if w in self.probabilities}
        if len(named) == 1:
            return named.pop()
        if not named:
            raise InvalidAction(f"{describe_text(action)} names no arm; answer with one of: {', '.join(self._order)}.")
        raise InvalidAction(f"{describe_text(action)} names {len(named)} arms ({', '.join(sorted(named))}); name exactly one.")

    def _step(self, action: str) -> StepResult:
        arm = self._parse(action)
        probability = self.probabilities[arm]
        if self.reward_mode == "expected":
            reward = probability
        else:
            reward = float(self.np_random.random() < probability)
        outcome = "paid out 1 point" if reward == 1 else "paid nothing" if reward == 0 else f"paid {reward:g}"
        return f"You pulled the {arm} arm. It {outcome}.", float(reward), True, False, {"arm": arm}
