"""The import contracts of pyproject.toml ([tool.importlinter]) break when a module imports against them: an engine
importing a trainer, the protocol importing the core, a loop between two sibling modules. That the tree keeps them is
`make lint`'s check (lint-imports on the tree, the first lane of `make test`)."""

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


#: (module, an import against the contracts, what lint-imports names as broken)
AGAINST_THE_GRAIN = [
    ("backends/torch/backend.py", "from tinkergym.trainers import base", "tinkergym.backends.torch.backend -> tinkergym.trainers.base"),  # engine imports trainer
    ("protocol/types.py", "from tinkergym import errors", "tinkergym.protocol.types -> tinkergym.errors"),  # protocol imports core
    ("rollouts.py", "from tinkergym.backends.torch import backend", "tinkergym.rollouts -> tinkergym.backends.torch.backend"),  # core imports engine
    ("backends/vllm/sampler.py", "from tinkergym.backends import remote", "tinkergym.backends.vllm.sampler -> tinkergym.backends.remote"),  # engine imports client
    ("scheduler/quotas.py", "from tinkergym.scheduler import repository", "No import loops"),  # a loop between siblings
    ("chat.py", "from tinkergym import games", "tinkergym.chat -> tinkergym.games"),  # a floor of the core the wrong way
    ("plumbing/timeline.py", "from tinkergym import core", "tinkergym.plumbing.timeline -> tinkergym.core"),  # plumbing imports the env contract
    ("sandbox/memory.py", "from tinkergym.sandbox import run", "tinkergym.sandbox.memory -> tinkergym.sandbox.run"),  # inside a sub-package
]


def test_each_import_against_the_contracts_breaks_them(tmp_path: Path) -> None:
    """Imports against the grain, each of another contract or layer, in one copy of the tree: one run of
    lint-imports names every one of them."""
    shutil.copytree(REPO / "tinkergym", tmp_path / "tinkergym", ignore=shutil.ignore_patterns("__pycache__"))
    for module, line, _ in AGAINST_THE_GRAIN:
        path = tmp_path / "tinkergym" / module
        path.write_text(path.read_text() + f"\n\ndef _against_the_grain():\n    {line}\n")  # an import inside a function counts too
    done = lint(tmp_path)
    assert done.returncode == 1, done.stdout[-3000:]
    assert "BROKEN" in done.stdout
    for module, _, broken in AGAINST_THE_GRAIN:
        assert broken in done.stdout, f"{module}: {broken!r} not reported\n{done.stdout[-3000:]}"
