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
#: Commits after SINCE whose subjects run past the limit and stay as they are (history is not rewritten).
EXEMPT = {"e00fe9fd73ae8192f0e9afb56c22089632136836", "f2769d3fb46cf17be4435d4e491a17d4aa7028ac",
          "23348a31b9f7ea06f6ecdb6a2be8c451905bd143",
          "954dffcc91bbe2afdad829df733e354be101f24d",
          "c56baea73318c8ae41b53869ffd8f1e560b75a9b",
}


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60)


def long_subjects(log: str, limit: int = LIMIT, exempt: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The subjects over ``limit`` characters in ``git log --format='%H %s'`` output, each with its commit and length."""
    commits = (line.split(" ", 1) for line in log.splitlines() if line)
    return [f"{commit[:12]} ({len(subject)} characters): {subject}" for commit, subject in commits if len(subject) > limit and commit not in exempt]


def test_long_subjects_are_named() -> None:
    log = f"{'a' * 40} {'x' * 72}\n{'b' * 40} {'y' * 73}\n{'c' * 40} {'z' * 80}\n"
    assert long_subjects(log, exempt={"c" * 40}) == [f"{'b' * 12} (73 characters): {'y' * 73}"]


def test_commit_subjects_fit_in_72_characters() -> None:
    if shutil.which("git") is None or _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip(f"{REPO} is not a git checkout: no commit subjects to check")
    if _git("cat-file", "-e", f"{SINCE}^{{commit}}").returncode != 0:
        pytest.skip(f"commit {SINCE[:12]} is not in this checkout's history (a shallow clone?): git fetch --unshallow checks the subjects")
    done = _git("log", "--format=%H %s", f"{SINCE}..HEAD")
    assert done.returncode == 0, done.stderr
    too_long = long_subjects(done.stdout, exempt=EXEMPT)
    assert not too_long, f"commit subjects over {LIMIT} characters (put the detail in the body):\n" + "\n".join(too_long)
