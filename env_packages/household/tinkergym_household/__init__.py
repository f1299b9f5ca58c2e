"""tinkergym-household: ``tinker/Household-v0``, ALFWorld-style household tasks in procedurally generated homes.

- :class:`HouseholdEnv`: the env (``tinkergym_household.env``).
- :func:`next_command`: the scripted planner, given the env (``tinkergym_household.planner``).
- :class:`PlannerAgent`: the same planner playing from the observation text (the baseline agent);
  :class:`RandomCommandAgent`: a random admissible command.
"""

from tinkergym_household.agents import PlannerAgent, RandomCommandAgent
from tinkergym_household.catalog import GOAL_KINDS
from tinkergym_household.env import HouseholdEnv
from tinkergym_household.generate import longest_plan
from tinkergym_household.planner import next_command

__all__ = ["GOAL_KINDS", "HouseholdEnv", "PlannerAgent", "RandomCommandAgent", "longest_plan", "next_command"]
