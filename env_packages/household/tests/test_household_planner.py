"""The scripted planner solves every generated task within the horizon; the text-reading baseline agent too."""

from __future__ import annotations

from collections import Counter

import pytest

from tinkergym.episodes import run_episode
from tinkergym_household import GOAL_KINDS, HouseholdEnv, PlannerAgent, RandomCommandAgent, longest_plan, next_command
from tinkergym_household.world import Home

#: (rooms, distractors): the easiest homes, the default, the largest.
DIFFICULTIES = [(1, 0), (3, 8), (6, 40)]


@pytest.mark.parametrize(("rooms", "distractors"), DIFFICULTIES)
def test_planner_solves_every_task_within_the_shortest_allowed_horizon(rooms: int, distractors: int) -> None:
    horizon = longest_plan(rooms, GOAL_KINDS)  # the smallest horizon the env accepts
    env = HouseholdEnv(rooms=rooms, distractors=distractors, horizon=horizon)
    kinds, lengths = Counter(), []
    for seed in range(200):
        _, info = env.reset(seed=seed)
        kinds[info["goal_kind"]] += 1
        while True:
            command = next_command(env)
            assert command in info["admissible_commands"], (seed, command)
            _, reward, terminated, truncated, info = env.step(command)
            if terminated or truncated:
                break
        assert terminated and info["is_success"] and reward > 0.9, f"seed {seed}: {env.home.goal.text} not done in {horizon}"
        lengths.append(info["steps"])
    assert set(kinds) == set(GOAL_KINDS)
    assert max(lengths) <= horizon and min(lengths) >= 3


def test_next_command_takes_a_wrapped_env_or_a_home_and_nothing_else() -> None:
    import gymnasium as gym

    env = gym.make("tinker/Household-v0")
    env.reset(seed=0)
    home = env.unwrapped.home
    assert isinstance(home, Home) and next_command(env) == next_command(home)
    with pytest.raises(TypeError, match="after reset"):
        next_command(HouseholdEnv())
    with pytest.raises(TypeError):
        next_command("kitchen")


def test_planner_recovers_from_a_random_start() -> None:
    """After random admissible commands (objects moved, doors shut, something else in hand) it still finishes."""
    env = HouseholdEnv(horizon=200)
    picked_other = 0
    for seed in range(60):
        _, info = env.reset(seed=seed)
        wander = RandomCommandAgent(seed=seed)
        done = False
        for _ in range(15):
            _, _, done, _, info = env.step(wander("", info))
            if done:
                break
        held = env.home.held()
        picked_other += held is not None and held.kind != env.home.goal.item
        while not done:
            _, _, done, truncated, info = env.step(next_command(env))
            assert not truncated and not info.get("invalid_action")
        assert info["is_success"]
    assert picked_other > 0, "some random starts leave another object in hand"


@pytest.mark.slow
@pytest.mark.parametrize(("rooms", "distractors"), DIFFICULTIES)
def test_baseline_agent_solves_from_text_alone(rooms: int, distractors: int) -> None:
    """The agent never sees the home: it searches, every command it gives is admissible, and it finishes in 50."""
    env = HouseholdEnv(rooms=rooms, distractors=distractors, horizon=50)
    solved, searched = 0, 0
    for seed in range(200):
        transcript = run_episode(env, PlannerAgent(), seed=seed)
        assert not any(t.info.get("invalid_action") or t.action == "look" for t in transcript.turns), seed
        solved += transcript.turns[-1].info["is_success"]
        searched += len(transcript.turns) > _planner_steps(env, seed)
    assert solved == 200
    assert searched > 20, "searching costs the agent commands the all-seeing planner does not need"


def _planner_steps(env: HouseholdEnv, seed: int) -> int:
    env.reset(seed=seed)
    for steps in range(1, env.horizon + 1):
        if env.step(next_command(env))[2]:
            return steps
    raise AssertionError(f"seed {seed}: the planner did not finish")


def test_agent_belief_matches_what_it_has_seen() -> None:
    env = HouseholdEnv(rooms=4, distractors=20, horizon=100)
    for seed in range(20):
        agent = PlannerAgent()
        observation, info = env.reset(seed=seed)
        while True:
            command = agent(observation, info)  # reads the observation into its belief first
            belief, home = agent.belief, env.home
            assert (belief.room, belief.at, belief.holding) == (home.room, home.at, home.holding)
            for name, receptacle in belief.receptacles.items():
                truth = home.receptacles[name]
                assert (receptacle.room, receptacle.is_open) == (truth.room, truth.is_open)
                if receptacle.known:
                    assert receptacle.contents == truth.contents, (seed, name)
            for name, room in belief.rooms.items():
                assert not room.explored or room.doors == home.rooms[name].doors
            observation, _, terminated, truncated, info = env.step(command)
            if terminated or truncated:
                break
        assert info["is_success"]
