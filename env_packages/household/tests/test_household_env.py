"""Tests of tinker/Household-v0: conformance, discovery, seeding, text, rules, rewards, kwargs."""

from __future__ import annotations

import copy
import json
import random
import re
import subprocess
import sys

import gymnasium as gym
import pytest
from click.testing import CliRunner

from tinkergym.errors import ConfigError
from tinkergym.testing import HOSTILE_ACTIONS, check_text_env
from tinkergym_household import GOAL_KINDS, HouseholdEnv, PlannerAgent, RandomCommandAgent, longest_plan, next_command
from tinkergym_household.agents import parse_goal
from tinkergym_household.catalog import LAMP, LOOK_IN_LIGHT, accepts
from tinkergym_household.world import goal_done

ENV_ID = "tinker/Household-v0"


def play_planner(env: HouseholdEnv, seed: int) -> list[tuple[str, str, float, dict]]:
    """The planner's episode: (command, observation, reward, info) per step."""
    env.reset(seed=seed)
    turns = []
    while True:
        command = next_command(env)
        observation, reward, terminated, truncated, info = env.step(command)
        turns.append((command, observation, reward, info))
        if terminated or truncated:
            return turns


def planner_until(env: HouseholdEnv, seed: int, verb: str) -> dict:
    """Reset with ``seed`` and follow the planner until its next command starts with ``verb``; the info of that state."""
    _, info = env.reset(seed=seed)
    while not next_command(env).startswith(verb):
        info = env.step(next_command(env))[4]
    return info


# ----- conformance and discovery ------------------------------------------------------------------
def test_conformance_with_gymnasium_check_env_our_checker_and_the_fuzz() -> None:
    check_text_env(HouseholdEnv(), baseline=PlannerAgent)
    check_text_env(gym.make(ENV_ID, rooms=1, distractors=0, horizon=20, subgoal_reward=0.1), baseline=RandomCommandAgent)
    check_text_env(HouseholdEnv(rooms=6, distractors=60, horizon=120, max_invalid_actions=3), baseline=PlannerAgent, seeds=(3,))


def test_listed_from_metadata_without_importing_the_package() -> None:
    code = (
        "import sys, tinkergym; spec = tinkergym.spec('tinker/Household-v0');"
        "print(spec.distribution, spec.turns, spec.baseline, 'tinkergym_household' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["tinkergym-household", "multi", "tinkergym_household.agents:PlannerAgent", "False"]
    from tinkergym.cli import main

    listed = CliRunner().invoke(main, ["envs", "list"])
    assert listed.exit_code == 0 and re.search(r"^tinker/Household-v0\s+tinkergym-household\s", listed.output, re.MULTILINE)


def test_import_is_light() -> None:
    code = "import sys, tinkergym_household; print(any(m in sys.modules for m in ('torch', 'transformers')))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_made_through_gymnasium_with_its_info() -> None:
    env = gym.make(ENV_ID, rooms=2, horizon=30)
    obs, info = env.reset(seed=1)
    assert {"system_prompt", "goal", "goal_kind", "admissible_commands", "horizon"} <= set(info)
    assert "You have 30 commands" in info["system_prompt"] and info["horizon"] == 30
    assert obs.endswith(f"Your task is to: {info['goal']}") and info["goal_kind"] in GOAL_KINDS
    assert info["admissible_commands"][-3:] == ["look", "inventory", "help"]
    obs, reward, terminated, truncated, info = env.step(info["admissible_commands"][0])
    assert set(info) == {"command", "admissible_commands", "steps", "goal_progress", "is_success"} and json.dumps(info)
    assert (terminated, truncated, info["steps"]) == (False, False, 1)


# ----- seeding and generation ---------------------------------------------------------------------
def test_same_seed_same_home_and_different_seeds_differ() -> None:
    first, second = HouseholdEnv(), HouseholdEnv()
    first.reset(seed=7)
    second.reset(seed=3)
    second.reset(seed=7)  # an earlier episode leaves no trace
    assert first.home == second.home
    homes = set()
    for seed in range(8):
        obs, info = first.reset(seed=seed)
        homes.add(obs)
    assert len(homes) == 8
    assert play_planner(first, 5) == play_planner(second, 5)


@pytest.mark.parametrize("kind", GOAL_KINDS)
def test_every_goal_kind_is_stated_solvable_and_not_done_at_the_start(kind: str) -> None:
    env = HouseholdEnv(goal_kinds=[kind])
    texts = set()
    for seed in range(25):
        obs, info = env.reset(seed=seed)
        home, goal = env.home, env.home.goal
        parsed = parse_goal(info["goal"])
        assert (parsed.kind, parsed.item, parsed.target) == (kind, goal.item, goal.target), info["goal"]
        assert not goal_done(home) and home.holding is None and home.reached == []
        items = [i for i in home.items.values() if i.kind == goal.item]
        assert len(items) >= goal.count
        if kind == LOOK_IN_LIGHT:
            assert any(i.kind == LAMP for i in home.items.values())
        else:
            assert all(home.receptacles[i.place].kind != goal.target for i in items)
            assert accepts(goal.target, goal.item)
        assert len(home.rooms) == 3 and sum(len(r.doors) for r in home.rooms.values()) == 4  # a tree of doors
        texts.add(info["goal"])
    assert len(texts) > 5


def test_text_reads_like_alfworld_with_numbered_names() -> None:
    env = HouseholdEnv(rooms=1, goal_kinds=["pick_cool_then_place"])
    obs, info = env.reset(seed=0)
    assert re.match(r"You are in the kitchen\. Looking quickly around you, you see (an? [a-z]+ \d+( \((open|closed)\))?(, |, and | and ))+an? [a-z]+ \d+", obs)
    assert "a fridge 1 (closed)" in obs and "a microwave 1 (closed)" in obs and "door" not in obs
    assert re.fullmatch(r"put an? cool [a-z]+ (in|on) (the|a|an) [a-z]+\.", info["goal"])
    obs = env.step("go to fridge 1")[0]
    assert obs == "You arrive at the fridge 1. The fridge 1 is closed."
    assert not any(c.startswith("take ") for c in env.step("look")[4]["admissible_commands"])
    obs = env.step("open fridge 1")[0]
    assert re.fullmatch(r"You open the fridge 1\. In the fridge 1, you see (nothing|an? [a-z]+ \d+.*)\.", obs)


# ----- rules --------------------------------------------------------------------------------------
def test_closed_containers_hide_their_contents_until_opened() -> None:
    env = HouseholdEnv(rooms=1)
    for seed in range(40):
        env.reset(seed=seed)
        full = [r for r in env.home.receptacles.values() if r.openable and r.contents and r.room == env.home.room]
        if full:
            break
    box = full[0]
    obs, _, _, _, info = env.step(f"go to {box.name}")
    assert obs.endswith(f"The {box.name} is closed.") and not any(c.startswith("take") for c in info["admissible_commands"])
    obs, _, _, _, info = env.step(f"open {box.name}")
    first = box.contents[0]
    assert f" {first}" in obs and f"take {first} from {box.name}" in info["admissible_commands"]
    assert f"close {box.name}" in info["admissible_commands"]


def test_doors_must_be_open_to_pass() -> None:
    env = HouseholdEnv(rooms=2)
    for seed in range(40):
        _, info = env.reset(seed=seed)
        (other, is_open), = env.home.rooms[env.home.room].doors.items()
        if not is_open:
            break
    assert f"go to {other}" not in info["admissible_commands"]
    obs, reward, *_ = env.step(f"go to {other}")
    assert "the door to the " + other + " is closed; open it first" in obs and reward == pytest.approx(-0.1)
    info = env.step(f"open door to {other}")[4]
    assert f"go to {other}" in info["admissible_commands"] and f"close door to {other}" in info["admissible_commands"]
    obs = env.step(f"go to {other}")[0]
    assert obs.startswith(f"You walk through the door into the {other}. You are in the {other}.")


def test_transforms_examine_and_inventory() -> None:
    env = HouseholdEnv(goal_kinds=["pick_heat_then_place"])
    planner_until(env, 2, "heat")
    held = env.home.holding
    assert env.step("inventory")[0] == f"You are carrying {'an' if held[0] in 'aeiou' else 'a'} {held}."
    assert env.step(f"examine {held}")[0] == f"You examine the {held}. There is nothing special about it."
    obs, reward, _, _, info = env.step(next_command(env))
    assert obs.startswith(f"You heat the {held} using the microwave")
    assert env.step(f"examine {held}")[0] == f"You examine the {held}. It is hot."
    assert f"heat {held} with {env.home.at}" in info["admissible_commands"]
    assert not any(c.startswith(("cool ", "clean ")) for c in info["admissible_commands"])  # a microwave only heats


def test_the_lamp_switches_and_lights_the_goal() -> None:
    env = HouseholdEnv(goal_kinds=[LOOK_IN_LIGHT])
    planner_until(env, 4, "use")
    lamp = next_command(env).split(" ", 1)[1]
    assert env.home.items[lamp].kind == LAMP and not env.home.items[lamp].lit
    obs, reward, terminated, _, info = env.step(f"use {lamp}")
    assert obs.startswith(f"You turn on the {lamp}.") and terminated and info["is_success"] and reward > 0.9


def test_help_lists_the_admissible_commands() -> None:
    env = HouseholdEnv()
    _, info = env.reset(seed=0)
    obs, reward, _, _, after = env.step("help")
    assert obs == "Admissible commands: " + ", ".join(info["admissible_commands"]) + "."
    assert reward == pytest.approx(-0.01) and after["admissible_commands"] == info["admissible_commands"]
    assert env.step("commands")[0] == obs


@pytest.mark.parametrize("form", ["{c}", "> {c}", "Action: {c}.", "  {C}  ", "I will do this.\n{c}", "{c}\nThat should work.", "`{c}`"])
def test_command_forms(form: str) -> None:
    env = HouseholdEnv()
    planner_until(env, 0, "take")
    command = next_command(env)
    before = copy.deepcopy(env)
    _, _, _, _, info = env.step(form.format(c=command, C=command.upper()))
    assert info.get("command") == command and env.home.holding is not None
    text = command.replace("take ", "take the ").replace(" from ", " from the ")
    assert before.step(text)[4].get("command") == command


def test_put_takes_any_preposition() -> None:
    env = HouseholdEnv()
    planner_until(env, 0, "put")
    command = next_command(env)
    prep = " in " if " in " in command else " on "
    for other in (" in/on ", " into ", " onto ", " in ", " on "):
        trial = copy.deepcopy(env)
        assert trial.step(command.replace(prep, other))[4].get("command") == command


# ----- rewards, bad actions, the horizon ----------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_reward_is_sparse_with_step_penalty_and_optional_shaping(seed: int) -> None:
    plain = play_planner(HouseholdEnv(), seed)
    assert [r for *_, r, _ in plain[:-1]] == [pytest.approx(-0.01)] * (len(plain) - 1)
    assert plain[-1][2] == pytest.approx(0.99) and plain[-1][3]["is_success"] and plain[-1][3]["goal_progress"] == 1.0
    shaped_env = HouseholdEnv(step_penalty=-0.02, subgoal_reward=0.25)
    shaped = play_planner(shaped_env, seed)
    assert [c for c, *_ in shaped] == [c for c, *_ in plain]
    subgoals = len(shaped_env.home.goal.subgoals()) - 1
    assert sum(r for _, _, r, _ in shaped) == pytest.approx(1 - 0.02 * len(shaped) + 0.25 * subgoals)
    bonus_steps = [i for i, (_, _, r, _) in enumerate(shaped[:-1]) if r > 0]
    assert len(bonus_steps) == subgoals and shaped[bonus_steps[0]][0].startswith("take ")
    progress = [info["goal_progress"] for *_, info in shaped]
    assert progress == sorted(progress) and progress[bonus_steps[0]] > 0 and progress[bonus_steps[0] - 1] == 0


def test_bad_actions_are_penalised_list_the_commands_and_use_the_horizon() -> None:
    env = HouseholdEnv(invalid_action_penalty=-0.5)
    env.reset(seed=0)
    for i, action in enumerate(["sing a song", "", None, "take moon 1 from sky 1", "x" * 9_000, "\ud800"], start=1):
        obs, reward, terminated, truncated, info = env.step(action)
        assert obs.startswith("Invalid action:") and reward == -0.5 and not (terminated or truncated)
        assert obs.splitlines()[-1] == "Admissible commands: " + ", ".join(info["admissible_commands"]) + "."
        assert info["invalid_action"] and info["steps"] == i and info["is_success"] is False and json.dumps(info)
    assert "not a command; a command starts with one of: go to, open" in env.step("dance")[0]


def test_hostile_actions_never_raise() -> None:
    env = HouseholdEnv(horizon=1_000)
    env.reset(seed=0)
    rng = random.Random(0)
    randoms = ["".join(chr(rng.randrange(32, 0x3000)) for _ in range(rng.randrange(40))) for _ in range(300)]
    shaped = ["put " + "a in \n" * 600, "the " * 1000, "go to " + "the " * 900, "> " * 2000, "open door to " + "living room " * 300]
    for action in [*HOSTILE_ACTIONS, *randoms, *shaped]:
        obs, reward, terminated, truncated, info = env.step(action)
        assert env.observation_space.contains(obs) and json.dumps(info) and reward in (-0.1, -0.01)
        assert obs.startswith("Invalid action: ") or info.get("command") in ("look", "inventory", "help")
        if terminated or truncated:
            env.reset()
    assert env.step("the the")[0].startswith("Invalid action: 'the the' is not a command")


def test_horizon_truncates_and_counts_every_command() -> None:
    horizon = longest_plan(3, GOAL_KINDS)
    env = HouseholdEnv(horizon=horizon)
    env.reset(seed=0)
    for i in range(1, horizon + 1):
        obs, reward, terminated, truncated, info = env.step("look" if i % 2 else "nonsense")
        assert not terminated and truncated == (i == horizon)
    assert obs.endswith(f"You have used all {horizon} commands; the task is not done.") and info["is_success"] is False
    assert env.step("look")[0].startswith("The episode is over")


def test_max_invalid_actions_ends_the_episode() -> None:
    env = HouseholdEnv(max_invalid_actions=2)
    env.reset(seed=0)
    assert not env.step("nope")[2]
    obs, reward, terminated, _, _ = env.step("nope")
    assert terminated and reward == pytest.approx(-0.1) and "the episode is over" in obs


def test_render_modes() -> None:
    env = HouseholdEnv(render_mode="ansi")
    obs, _ = env.reset(seed=0)
    assert env.render() == obs
    obs = env.step("look")[0]
    assert env.render() == obs


# ----- kwargs -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [
        {"rooms": 0}, {"rooms": 7}, {"rooms": 2.0}, {"rooms": True}, {"distractors": -1}, {"distractors": 61},
        {"horizon": 20}, {"horizon": 1001}, {"horizon": "50"}, {"goal_kinds": []}, {"goal_kinds": ["fly"]},
        {"goal_kinds": "pick_and_place,fetch"}, {"goal_kinds": 3}, {"step_penalty": 0.1}, {"step_penalty": float("nan")},
        {"subgoal_reward": -1}, {"subgoal_reward": "0.1"}, {"invalid_action_penalty": 1}, {"invalid_action_penalty": -1e9},
        {"max_invalid_actions": 0}, {"render_mode": "rgb_array"},
    ],
)
@pytest.mark.filterwarnings("ignore:.*render_mode:UserWarning")
def test_bad_kwargs_raise_config_error(kwargs: dict) -> None:
    (name, value), = kwargs.items()
    with pytest.raises(ConfigError, match=re.escape(f"{name}={value!r}")):
        HouseholdEnv(**kwargs)
    with pytest.raises(ConfigError, match=name):
        gym.make(ENV_ID, **kwargs)


def test_horizon_error_names_the_shortest_safe_horizon() -> None:
    with pytest.raises(ConfigError, match="from 36 to 1000; with rooms=6"):
        HouseholdEnv(rooms=6, horizon=35)
    assert HouseholdEnv(rooms=6, horizon=36, goal_kinds="pick_and_place").goal_kinds == ("pick_and_place",)
    assert HouseholdEnv(rooms=6, horizon=20, goal_kinds=["look_at_obj_in_light"]).horizon == 20  # 3 * 5 + 5


def test_reset_options_are_refused() -> None:
    env = HouseholdEnv()
    with pytest.raises(ConfigError, match="takes no options"):
        env.reset(seed=0, options={"goal": "x"})
    assert env.reset(seed=0, options={})[0]
