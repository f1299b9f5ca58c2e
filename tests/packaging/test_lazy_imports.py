"""``import tinkergym``, making any shipped env, the rollout loop, the trainers' client side and the CLI import no
torch (nor any other heavy library), and listing imports no env package."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = r"""
import json, sys
import tinkergym
after_import = sorted(m for m in sys.modules if m.startswith("tinkergym_"))
specs = tinkergym.list_envs()
after_list = sorted(m for m in sys.modules if m.startswith("tinkergym_"))
made, unavailable = [], []
for s in specs:
    try:
        env = tinkergym.make_aec(s.id) if s.kind == "aec" else tinkergym.make(s.id)
    except tinkergym.errors.EnvUnavailableError:
        unavailable.append(s.id)  # data it needs is not installed here: it says so at once, never downloads
        continue
    env.reset(seed=0)
    made.append(s.id)
import tinkergym.rollouts, tinkergym.chat, tinkergym.cli, tinkergym.trainers.grpo, tinkergym.trainers.session  # noqa
heavy = sorted(m for m in ("torch", "transformers", "peft", "vllm", "ray", "fastapi", "huggingface_hub") if m in sys.modules)
print(json.dumps({"after_import": after_import, "after_list": after_list, "made": made, "unavailable": unavailable, "heavy": heavy}))
"""


@pytest.mark.slow
def test_core_and_every_shipped_env_stay_light() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["after_import"] == [] and report["after_list"] == [], "env packages must be imported only when made"
    assert "tinker/Bandit-v0" in report["made"]
    assert report["heavy"] == []
