"""The import contracts of pyproject.toml ([tool.importlinter]) hold for the tree, and break when a module imports
against them: an engine importing a trainer, the protocol importing the core, a loop between two sibling modules."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (the dev extra has it)")


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` on the package under ``root`` with the repository's contracts."""
    return subprocess.run([str(LINT), "--config", str(REPO / "pyproject.toml"), "--no-cache"], cwd=root, capture_output=True, text=True,
                          timeout=300, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tree")
    shutil.copytree(REPO / "tinkergym", root / "tinkergym", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_the_tree_keeps_every_contract() -> None:
    done = lint(REPO)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout


@pytest.mark.parametrize(("module", "line", "broken"), [
    ("backends/torch/backend.py", "from tinkergym.trainers import base", "tinkergym.backends.torch.backend -> tinkergym.trainers.base"),
    ("protocol/types.py", "from tinkergym import errors", "tinkergym.protocol.types -> tinkergym.errors"),
    ("rollouts.py", "from tinkergym.backends.torch import backend", "tinkergym.rollouts -> tinkergym.backends.torch.backend"),
    ("backends/vllm/sampler.py", "from tinkergym.backends import remote", "tinkergym.backends.vllm.sampler -> tinkergym.backends.remote"),
    ("scheduler/quotas.py", "from tinkergym.scheduler import repository", "No import loops"),
], ids=["engine-imports-trainer", "protocol-imports-core", "core-imports-engine", "engine-imports-client", "loop"])
def test_an_import_against_the_contracts_breaks_them(copy: Path, module: str, line: str, broken: str) -> None:
    path = copy / "tinkergym" / module
    original = path.read_text()
    try:
        path.write_text(original + f"\n\ndef _against_the_grain():\n    {line}\n")  # an import inside a function counts too
        done = lint(copy)
    finally:
        path.write_text(original)
    assert done.returncode == 1, done.stdout[-3000:]
    assert broken in done.stdout and "BROKEN" in done.stdout, done.stdout[-3000:]
