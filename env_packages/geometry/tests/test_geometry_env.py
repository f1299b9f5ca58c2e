"""Tests of tinker/Geometry-v0, tinker/GeometryTool-v0 and tinker/ColourSquare-v0."""

from __future__ import annotations

import json
from fractions import Fraction

import gymnasium as gym
import numpy as np
import pytest

import tinkergym
from tinkergym.chat import observation_message
from tinkergym.episodes import run_episode
from tinkergym.errors import ConfigError
from tinkergym.spaces import TextWithImages
from tinkergym.testing import check_text_env
from tinkergym_geometry import (
    KINDS,
    BaselineColourAgent,
    BaselineGeometryAgent,
    BaselineGeometryToolAgent,
    ColourSquareEnv,
    GeometryEnv,
    GeometryToolEnv,
)
from tinkergym_geometry.grading import grade_number

IDS = {
    "tinker/Geometry-v0": BaselineGeometryAgent,
    "tinker/GeometryTool-v0": BaselineGeometryToolAgent,
    "tinker/ColourSquare-v0": BaselineColourAgent,
}


@pytest.mark.parametrize("env_id", sorted(IDS))
def test_conformance_through_the_hub(env_id: str) -> None:
    env = tinkergym.make(env_id)
    assert isinstance(env.observation_space, TextWithImages)
    assert tinkergym.spec(env_id).distribution == "tinkergym-geometry"
    check_text_env(env, baseline=IDS[env_id], fuzz_count=50)


@pytest.mark.parametrize("env_id", sorted(IDS))
def test_baseline_solves_every_episode(env_id: str) -> None:
    env = gym.make(env_id)
    for seed in range(40):
        transcript = run_episode(env, IDS[env_id](seed=seed), seed=seed)
        assert transcript.returns["agent"] == 1.0, (seed, transcript.turns[-1].observation["text"])


@pytest.mark.parametrize("make", [GeometryEnv, ColourSquareEnv])
def test_same_seed_same_pixels_and_question(make) -> None:
    first, second = make(), make()
    images = []
    for seed in (0, 0, 1, 2):
        a, info_a = first.reset(seed=seed)
        b, info_b = second.reset(seed=seed)
        assert a["text"] == b["text"] and json.dumps(info_a) == json.dumps(info_b)
        assert len(a["images"]) == 1 and np.array_equal(a["images"][0], b["images"][0])
        assert a["images"][0] is not b["images"][0]
        images.append(a["images"][0])
    assert np.array_equal(images[0], images[1])
    assert not np.array_equal(images[1], images[2]) or not np.array_equal(images[1], images[3])


def test_every_kind_is_drawn_described_and_answered() -> None:
    env = GeometryEnv(render_mode="rgb_array")
    for kind in KINDS:
        observation, info = env.reset(seed=3, options={"kind": kind})
        assert info["kind"] == kind and observation["text"].startswith(info["question"])
        image = observation["images"][0]
        assert image.shape == (256, 256, 3) and image.dtype == np.uint8
        assert (image < 128).any() and (image == 255).any()  # ink on white
        assert np.array_equal(env.render(), image)
        for value in info["given"].values():  # the text fallback names every given value
            assert str(value) in info["figure_description"]
        assert not any("answer" in key for key in info)  # the answer is never in reset info
        _, reward, terminated, _, step_info = env.step(BaselineGeometryAgent()(observation, info))
        assert reward == 1.0 and terminated and step_info["correct"]


def test_wrong_and_missing_answers_score_zero() -> None:
    env = GeometryEnv(kinds=("triangle_angle",))
    _, info = env.reset(seed=0)
    answer = 180 - info["given"]["angle_A"] - info["given"]["angle_B"]
    observation, reward, terminated, _, step_info = env.step(f"\\boxed{{{answer + 1}}}")
    assert reward == 0.0 and terminated and step_info["expected_answer"] == str(answer)
    assert observation["images"] == () and "Incorrect" in observation["text"]
    env.reset(seed=0)
    observation, reward, *_ = env.step("I do not know.")
    assert reward == 0.0 and "No final answer" in observation["text"]


def test_rounding_tolerance_fits_the_stated_rounding() -> None:
    truth = 25 * np.pi  # 78.5398...
    assert grade_number("\\boxed{78.54}", None, truth, 2).correct
    assert grade_number("\\boxed{78.5398}", None, truth, 2).correct
    assert not grade_number("\\boxed{78.5}", None, truth, 2).correct
    assert not grade_number("\\boxed{78.55}", None, truth, 2).correct
    assert grade_number("\\boxed{\\frac{45}{2}}", Fraction(45, 2), 22.5, None).correct
    assert grade_number("Answer: 22.5", Fraction(45, 2), 22.5, None).correct
    assert not grade_number("\\boxed{22}", Fraction(45, 2), 22.5, None).correct
    assert not grade_number("\\boxed{22.49}", Fraction(45, 2), 22.5, None).correct


def test_colour_square_reads_the_last_colour_named() -> None:
    env = ColourSquareEnv(colours=("green", "yellow"))
    observation, info = env.reset(seed=5)
    assert observation["images"][0].shape == (64, 64, 3) and info["colours"] == ["green", "yellow"]
    colour = info["figure_description"].split("filled with ")[1].split()[0]
    other = "yellow" if colour == "green" else "green"
    assert env.step(f"Not {other}, it is {colour.upper()}.")[1] == 1.0
    env.reset(seed=5)
    assert env.step(f"{colour}? no: {other}")[1] == 0.0
    env.reset(seed=5)
    assert env.step("purple")[1] == 0.0
    colours = {ColourSquareEnv().reset(seed=s)[1]["figure_description"] for s in range(20)}
    assert len(colours) == 2  # both colours occur


def test_tool_env_calculator_turn_then_answer() -> None:
    env = GeometryToolEnv(kinds=("right_triangle",), tools=("calculator",), max_tool_calls=1)
    observation, info = env.reset(seed=1)
    assert [t["function"]["name"] for t in info["tools"]] == ["calculator"]
    assert len(observation["images"]) == 1 and "calculator" in info["system_prompt"]
    a, b = info["given"]["leg_a"], info["given"]["leg_b"]
    call = json.dumps({"name": "calculator", "arguments": {"expression": f"sqrt({a}^2 + {b}^2)"}})
    observation, reward, terminated, _, step_info = env.step(f"<tool_call>{call}</tool_call>")
    assert reward == 0.0 and not terminated and step_info["tool_calls_used"] == 1 and observation["images"] == ()
    assert "<tool_response>" in observation["text"] and "graded as the final answer" in observation["text"]
    _, reward, terminated, _, step_info = env.step(f"<tool_call>{call}</tool_call> \\boxed{{{np.hypot(a, b):.2f}}}")
    assert terminated and reward == 1.0 and step_info["turn"] == 2


def test_bad_arguments_are_config_errors() -> None:
    for make in (lambda: GeometryEnv(kinds=("hexagon",)), lambda: ColourSquareEnv(colours=("red", "red")), lambda: GeometryToolEnv(tools=("shell",))):
        with pytest.raises(ConfigError):
            make()


def test_reset_observation_becomes_a_chat_message_with_its_image() -> None:
    observation, _ = GeometryEnv().reset(seed=0)
    message, images = observation_message(observation)
    assert message["role"] == "user" and message["content"][0] == {"type": "image"}
    assert message["content"][1] == {"type": "text", "text": observation["text"]}
    assert len(images) == 1 and images[0] is observation["images"][0]
    feedback, _, _, _, _ = GeometryEnv().step("x")  # over before reset: plain text, no images
    assert observation_message(feedback) == ({"role": "user", "content": feedback["text"]}, [])


def test_listed_from_metadata_without_importing_the_package_or_pillow() -> None:
    import subprocess
    import sys

    code = (
        "import sys, tinkergym; specs = {s.id: s for s in tinkergym.list_envs()}; "
        "print(sorted(i for i in specs if 'Geometry' in i or 'Colour' in i), specs['tinker/GeometryTool-v0'].turns, "
        "'tinkergym_geometry' in sys.modules, 'PIL' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "['tinker/ColourSquare-v0', 'tinker/Geometry-v0', 'tinker/GeometryTool-v0'] multi False False"
