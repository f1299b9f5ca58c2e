"""``tinkergym envs new`` makes a package that installs, registers, lists, passes its own tests and uninstalls."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from tinkergym.cli import main
from tinkergym.errors import ScaffoldError
from tinkergym.registry.scaffold import PackagePlan, scaffold_package


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.mark.slow
def test_new_package_installs_and_works_end_to_end(tmp_path) -> None:
    result = CliRunner().invoke(main, ["envs", "new", "demo-maze", "--dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    root = tmp_path / "tinkergym-demo-maze"
    assert "demo_maze/DemoMaze-v0" in result.output
    installed = _run("-m", "pip", "install", "--no-build-isolation", "--no-deps", "-q", "-e", str(root))
    assert installed.returncode == 0, installed.stderr
    try:
        made = _run("-c", "import gymnasium as gym, tinkergym\nenv = gym.make('demo_maze/DemoMaze-v0')\nprint(env.reset(seed=0)[0])")
        assert made.returncode == 0, made.stderr
        assert "Guess a number from 1 to 100" in made.stdout
        listed = _run("-m", "tinkergym", "envs", "list")
        assert any(line.startswith("demo_maze/DemoMaze-v0") and "tinkergym-demo-maze" in line for line in listed.stdout.splitlines()), listed.stdout
        checked = _run("-m", "tinkergym", "envs", "check", "demo_maze/DemoMaze-v0")
        assert checked.returncode == 0, checked.stdout + checked.stderr
        tests = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(root / "tests"), cwd=root)
        assert tests.returncode == 0, tests.stdout + tests.stderr
        assert "3 passed" in tests.stdout
    finally:
        removed = _run("-m", "pip", "uninstall", "-y", "-q", "tinkergym-demo-maze")
        assert removed.returncode == 0, removed.stderr
    gone = _run("-m", "tinkergym", "envs", "list")
    assert "demo_maze/DemoMaze-v0" not in gone.stdout


def test_plan_names() -> None:
    plan = PackagePlan.for_name("maze-runner")
    assert (plan.dist, plan.module, plan.env_id, plan.class_name) == (
        "tinkergym-maze-runner", "tinkergym_maze_runner", "maze_runner/MazeRunner-v0", "MazeRunnerEnv"
    )
    assert PackagePlan.for_name("tinkergym-chess", env_id="acme/Chess-v2").env_id == "acme/Chess-v2"


@pytest.mark.parametrize(("name", "env_id"), [("Bad Name", None), ("9lives", None), ("ok", "NoVersion"), ("ok", "noNamespace-v0")])
def test_bad_names_are_refused(name, env_id) -> None:
    with pytest.raises(ScaffoldError):
        PackagePlan.for_name(name, env_id)


def test_refuses_to_overwrite_a_non_empty_folder(tmp_path) -> None:
    scaffold_package("wordle", tmp_path)
    with pytest.raises(ScaffoldError, match="--force"):
        scaffold_package("wordle", tmp_path)
    scaffold_package("wordle", tmp_path, force=True)
