"""Every discovered env passes the conformance checker that matches its kind, with its package's baseline."""

from __future__ import annotations

import pytest

import tinkergym
from tinkergym.registry import load_baseline
from tinkergym.testing import check_text_aec_env, check_text_env

SHIPPED = {"tinker/Gomoku-v0", "tinker/GomokuDuel-v0", "tinker/Math-v0", "tinker/MathTool-v0", "tinker/Bandit-v0"}


def test_every_shipped_env_is_discovered() -> None:
    assert SHIPPED <= {s.id for s in tinkergym.list_envs()}


@pytest.mark.parametrize("env_spec", tinkergym.list_envs(), ids=lambda s: s.id)
def test_env_conforms(env_spec) -> None:
    baseline = load_baseline(env_spec)
    if env_spec.kind == "aec":
        check_text_aec_env(tinkergym.make_aec(env_spec.id), baseline=baseline)
    else:
        check_text_env(tinkergym.make(env_spec.id), baseline=baseline)
