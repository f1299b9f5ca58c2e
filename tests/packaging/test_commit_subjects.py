"""Commit subjects fit in 72 characters (``git log --oneline``, a terminal, a pull request's title), the detail goes
in the body. Checked for the commits after ``SINCE``; older ones were written before the limit and are left as they are.

Skipped where the tree is not a git checkout or ``SINCE`` is not in its history (a shallow clone); CI clones fully.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
#: The last commit before the limit held; its subject and those before it are not checked.
SINCE = "74cbd480919398c269d5a504121b5ab1edb9b858"
LIMIT = 72


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60)


def long_subjects(subjects: list[str], limit: int = LIMIT) -> list[str]:
    """The subjects over ``limit`` characters, each with its length."""
    return [f"{len(subject)} characters: {subject}" for subject in subjects if len(subject) > limit]


def test_long_subjects_are_named() -> None:
    assert long_subjects(["x" * 72, "y" * 73]) == ["73 characters: " + "y" * 73]


def test_commit_subjects_fit_in_72_characters() -> None:
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip(f"{REPO} is not a git checkout: no commit subjects to check")
    if _git("cat-file", "-e", f"{SINCE}^{{commit}}").returncode != 0:
        pytest.skip(f"commit {SINCE[:12]} is not in this checkout's history (a shallow clone?): git fetch --unshallow checks the subjects")
    done = _git("log", "--format=%s", f"{SINCE}..HEAD")
    assert done.returncode == 0, done.stderr
    too_long = long_subjects(done.stdout.splitlines())
    assert not too_long, f"commit subjects over {LIMIT} characters (put the detail in the body):\n" + "\n".join(too_long)
