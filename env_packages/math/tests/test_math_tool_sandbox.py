"""tinker/MathTool-v0's python tool on the real sandbox: hostile tool calls, refusal, and the opt-in."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import gymnasium as gym
import pytest

import tinkergym  # noqa: F401  (registers the ids)
from tinkergym.errors import ConfigError, SandboxUnavailableError


def _call(env, code: str) -> str:
    call = json.dumps({"name": "python", "arguments": {"code": code}})
    obs, reward, terminated, truncated, info = env.step(f"<tool_call>{call}</tool_call>")
    assert not terminated and not truncated
    return info["tool_results"][0]["content"]


def test_a_hostile_tool_call_reaches_nothing_of_the_host(tmp_path):
    secret = f"secret-{uuid.uuid4().hex}"
    planted = Path.home() / f".tinkergym-planted-{uuid.uuid4().hex}"
    planted.write_text(secret)
    planted.chmod(0o600)
    try:
        env = gym.make("tinker/MathTool-v0", max_tool_calls=4)
        env.reset(seed=0)
        code = (
            "import os\n"
            f"for path in ({str(planted)!r}, '/etc/shadow', {str(Path.cwd() / 'README.md')!r}):\n"
            "    try:\n"
            "        print(open(path).read()[:60])\n"
            "    except OSError as exc:\n"
            "        print(type(exc).__name__)\n"
            "print(os.getuid(), sorted(os.listdir('/')))\n"
        )
        result = _call(env, code)
        assert secret not in result
        lines = result.splitlines()
        assert lines[:3] == ["FileNotFoundError"] * 3, result
        if os.geteuid() == 0:
            assert lines[3].startswith("65534 ")
    finally:
        planted.unlink()


def test_refuses_to_be_made_without_bubblewrap_unless_opted_in(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailableError, match="bubblewrap") as caught:
        gym.make("tinker/MathTool-v0")
    message = str(caught.value)
    assert "apt-get install bubblewrap" in message and "python_sandbox='rlimits'" in message
    assert "tools=['calculator']" in message
    # The calculator alone needs no sandbox; the opt-in runs code under the weaker guard, never as root.
    gym.make("tinker/MathTool-v0", tools=["calculator"]).reset(seed=0)
    env = gym.make("tinker/MathTool-v0", python_sandbox="rlimits")
    env.reset(seed=0)
    uid = _call(env, "import os\nos.getuid()")
    assert uid == ("65534" if os.geteuid() == 0 else str(os.geteuid()))


def test_bad_sandbox_kwargs_are_config_errors():
    with pytest.raises(ConfigError, match="python_sandbox='docker'"):
        gym.make("tinker/MathTool-v0", python_sandbox="docker")
    with pytest.raises(ConfigError, match="python_executable='/nonexistent/python3'"):
        gym.make("tinker/MathTool-v0", python_executable="/nonexistent/python3")
