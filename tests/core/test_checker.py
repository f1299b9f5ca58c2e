"""The conformance checkers pass good envs and catch each kind of breakage."""

from __future__ import annotations

import random

import pytest

from tinkergym import InvalidAction, TextAECEnv, TextEnv
from tinkergym.errors import CheckFailed
from tinkergym.testing import check_text_aec_env, check_text_env


class GuessEnv(TextEnv):
    """Guess a seeded digit; 3 tries."""

    max_action_length = 256
    max_observation_length = 512

    def _reset(self, options):
        self.secret, self.tries = int(self.np_random.integers(10)), 0
        return "Guess a digit.", {}

    def _step(self, action):
        if not action.strip().isdigit() or len(action.strip()) != 1:
            raise InvalidAction("answer with one digit")
        self.tries += 1
        won = int(action) == self.secret
        return ("right" if won else "wrong"), float(won), won or self.tries >= 3, False, {"tries": self.tries}


class DigitAgent:
    """Guesses 0, 1, 2..."""

    def __init__(self, seed=None):
        self.n = 0

    def __call__(self, observation, info):
        self.n += 1
        return str(self.n - 1)


def test_a_good_env_passes() -> None:
    check_text_env(GuessEnv(), baseline=DigitAgent)
    check_text_env(GuessEnv())  # random-text agent


class RaisingEnv(GuessEnv):
    def _step(self, action):
        return super()._step(action) if action.strip() else ({}["boom"])


class AlwaysRaisingEnv(GuessEnv):
    """Raises on every step, so Gymnasium's own suite (random actions) meets the exception first."""

    def _step(self, action):
        raise RuntimeError("broken step")


class NonDeterministicEnv(GuessEnv):
    def _reset(self, options):
        obs, info = super()._reset(options)
        self.secret = random.randrange(10**9)
        return obs, info

    def _step(self, action):
        obs, r, term, trunc, info = super()._step(action)
        return f"{obs} {self.secret}", r, term, trunc, info


class ControlCharEnv(GuessEnv):
    def _step(self, action):
        obs, *rest = super()._step(action)
        return obs + "\x07", *rest


class NanRewardEnv(GuessEnv):
    def _step(self, action):
        obs, r, *rest = super()._step(action)
        return obs, float("nan"), *rest


class NumpyInfoEnv(GuessEnv):
    def _step(self, action):
        obs, r, term, trunc, info = super()._step(action)
        return obs, r, term, trunc, {"secret": self.np_random.integers(3, size=2)}


@pytest.mark.parametrize(
    ("env_class", "message"),
    [
        (RaisingEnv, "raised KeyError"),
        (AlwaysRaisingEnv, "raised RuntimeError"),
        (NonDeterministicEnv, "differ"),
        (ControlCharEnv, "not inside"),
        (NanRewardEnv, "not a finite number"),
        (NumpyInfoEnv, "not JSON-serializable"),
    ],
)
def test_each_breakage_is_caught(env_class, message) -> None:
    with pytest.raises(CheckFailed, match=message):
        check_text_env(env_class(), baseline=DigitAgent)


def test_exemptions_come_from_metadata() -> None:
    class ExemptEnv(NonDeterministicEnv):
        metadata = {**TextEnv.metadata, "tinkergym": {"checker_skip": ("determinism", "peer")}}

    check_text_env(ExemptEnv(), baseline=DigitAgent)

    class TypoEnv(GuessEnv):
        metadata = {**TextEnv.metadata, "tinkergym": {"checker_skip": ("determinsm",)}}

    with pytest.raises(CheckFailed, match="unknown checks"):
        check_text_env(TypoEnv())


class PassEnv(TextAECEnv):
    """Pass a token around; whoever says "stop" after the fifth pass wins."""

    max_invalid_actions = 2
    max_action_length = 64

    def _reset_game(self, options):
        self.passes = 0
        return "player_0"

    def _observe(self, agent):
        return f"{self.passes} passes so far."

    def _play(self, agent, action):
        word = action.strip().lower()
        if word not in ("pass", "stop"):
            raise InvalidAction("say pass or stop")
        if word == "stop":
            won = self.passes >= 5
            return {a: (1.0 if (a == agent) == won else -1.0) for a in self.agents}
        self.passes += 1
        return None


class PassAgent:
    def __init__(self, seed=None):
        self.turns = 0

    def __call__(self, observation, info):
        self.turns += 1
        return "stop" if self.turns > 3 else "pass"


def test_a_good_aec_env_passes() -> None:
    check_text_aec_env(PassEnv(), baseline=PassAgent)


def test_the_aec_checker_keeps_pettingzoos_prints_off_stdout_but_not_a_failure(capsys: pytest.CaptureFixture[str]) -> None:
    check_text_aec_env(PassEnv(), baseline=PassAgent)
    assert capsys.readouterr().out == ""  # api_test prints "Starting API test" and "Passed API test" on its own

    class NoisyFragileEnv(PassEnv):
        def _play(self, agent, action):
            print("the env says: about to fail")
            raise RuntimeError("broken on purpose")

    with pytest.raises(CheckFailed, match=r"api_test: the env raised RuntimeError: broken on purpose \(it printed: the env says: about to fail"):
        check_text_aec_env(NoisyFragileEnv(), baseline=PassAgent, fuzz_count=0)
    assert capsys.readouterr().out == ""


def test_aec_breakage_is_caught() -> None:
    class ChattyEnv(PassEnv):
        def _observe(self, agent):
            return super()._observe(agent) + "\x00"

    with pytest.raises(CheckFailed):
        check_text_aec_env(ChattyEnv(), baseline=PassAgent)

    class FragileEnv(PassEnv):
        def _play(self, agent, action):
            return super()._play(agent, action.encode("ascii").decode())

    with pytest.raises(CheckFailed, match="raised"):
        check_text_aec_env(FragileEnv(), baseline=PassAgent, fuzz_count=0)
