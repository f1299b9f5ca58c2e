"""The text-env contract: spaces, TextEnv and TextAECEnv behaviour on bad actions."""

from __future__ import annotations

import pytest

from tinkergym import InvalidAction, PrintableText, TextAECEnv, TextEnv
from tinkergym.errors import ConfigError
from tinkergym.spaces import describe_text


class CountdownEnv(TextEnv):
    """Say numbers counting down from 3; a wrong number is invalid; two invalid actions forfeit."""

    invalid_action_penalty = -0.5
    max_invalid_actions = 2
    forfeit_reward = -1.0
    max_action_length = 64
    system_prompt = "Count down from 3."

    def _reset(self, options):
        self.next = int(options.get("start", 3))
        return f"Say {self.next}.", {"start": self.next}

    def _step(self, action):
        if action.strip() != str(self.next):
            raise InvalidAction(f"expected {self.next}, got {describe_text(action)}")
        self.next -= 1
        return f"Say {self.next}.", 1.0, self.next == 0, False, {}


def test_printable_text_admits_any_printable_text() -> None:
    space = PrintableText(20)
    assert space.contains("H8, let's go! Ω 日本 🙂")
    assert space.contains("line one\nline\ttwo\r\n")
    assert space.contains("")
    assert not space.contains("x" * 21)
    assert not space.contains("bell\x07")
    assert not space.contains(b"bytes")
    assert all(space.contains(space.sample()) for _ in range(50))
    assert PrintableText(20) == PrintableText(20) != PrintableText(21)


def test_reset_puts_system_prompt_in_info_and_options_reach_the_env() -> None:
    env = CountdownEnv()
    obs, info = env.reset(seed=0, options={"start": 2})
    assert obs == "Say 2." and info == {"system_prompt": "Count down from 3.", "start": 2}


def test_valid_episode() -> None:
    env = CountdownEnv()
    env.reset(seed=0)
    results = [env.step(s) for s in ("3", " 2 ", "1")]
    assert [r[1] for r in results] == [1.0, 1.0, 1.0]
    assert [r[2] for r in results] == [False, False, True]


@pytest.mark.parametrize("action", ["7", "", None, 42, "x" * 65, "\ud800", ["3"]])
def test_bad_action_is_an_observation_with_the_penalty(action) -> None:
    env = CountdownEnv()
    env.reset(seed=0)
    obs, reward, terminated, truncated, info = env.step(action)
    assert obs.startswith("Invalid action:") and "Try again." in obs
    assert reward == -0.5 and not terminated and not truncated
    assert info == {"invalid_action": True, "error": info["error"], "invalid_actions": 1}


def test_too_many_invalid_actions_forfeit_and_reset_clears_the_count() -> None:
    env = CountdownEnv()
    env.reset(seed=0)
    env.step("nope")
    obs, reward, terminated, _, info = env.step("nope")
    assert terminated and reward == -1.0 and "invalid action 2 of 2" in obs
    obs, reward, terminated, _, _ = env.step("3")
    assert "reset()" in obs and reward == 0.0 and terminated
    env.reset(seed=0)
    assert env.step("nope")[2] is False


def test_bytes_are_decoded_and_bytes_over_the_limit_rejected() -> None:
    env = CountdownEnv()
    env.reset(seed=0)
    assert env.step(b"3")[1] == 1.0
    assert "characters long; the limit is 64" in env.step("9" * 100)[0]


def test_render_modes() -> None:
    env = CountdownEnv(render_mode="ansi")
    env.reset(seed=0)
    env.step("3")
    assert env.render() == "Say 2."
    with pytest.raises(ConfigError, match="render_mode='rgb_array'"):
        CountdownEnv(render_mode="rgb_array")


class NimEnv(TextAECEnv):
    """Two players take 1-3 stones from a pile of 7; whoever takes the last stone wins."""

    max_invalid_actions = 3
    max_action_length = 32
    system_prompt = "Take 1, 2 or 3 stones."

    def _reset_game(self, options):
        self.pile = int(options.get("pile", 7))
        return "player_0"

    def _observe(self, agent):
        return f"{self.pile} stones left."

    def _play(self, agent, action):
        if action.strip() not in ("1", "2", "3") or int(action) > self.pile:
            raise InvalidAction(f"take 1, 2 or 3 stones (at most {self.pile}), not {describe_text(action)}")
        self.pile -= int(action)
        if self.pile == 0:
            return {a: (1.0 if a == agent else -1.0) for a in self.agents}
        return None


def test_aec_turns_rewards_and_game_end() -> None:
    env = NimEnv()
    env.reset(seed=0)
    assert env.infos["player_0"]["system_prompt"] == "Take 1, 2 or 3 stones."
    for take in ("3", "3"):
        env.step(take)
    assert env.agent_selection == "player_0" and env.observe("player_0") == "1 stones left."
    env.step("1")
    assert all(env.terminations.values())
    assert env.rewards == {"player_0": 1.0, "player_1": -1.0}


def test_aec_bad_action_keeps_the_turn_shows_feedback_and_forfeits() -> None:
    env = NimEnv()
    env.reset(seed=0)
    env.step("five")
    assert env.agent_selection == "player_0"
    assert env.rewards["player_0"] == -0.1
    assert env.observe("player_0").startswith("Invalid action: take 1, 2 or 3 stones")
    assert "error" in env.infos["player_0"]
    env.step("1")
    assert "Invalid" not in env.observe("player_0") and "error" not in env.infos["player_0"]
    for _ in range(3):
        env.step(None)
    assert all(env.terminations.values())
    assert env.rewards == {"player_0": 1.0, "player_1": -1.0}
    assert "you forfeit" in env.observe("player_1")
