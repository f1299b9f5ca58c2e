"""A command whose extra is not installed says which extra to install, in one line and exit code 1, never a traceback
(run as an install without the module would: the module is made unimportable in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tinkergym.cli.common import missing_extra

WITHOUT = """
import sys
sys.modules[{module!r}] = None
from tinkergym.cli import main
main({args!r})
"""


@pytest.mark.parametrize("module, args, extra", [
    ("sqlalchemy", ["scheduler", "keys", "list"], "scheduler"),
    ("alembic", ["scheduler", "db", "current"], "scheduler"),
])
def test_a_missing_module_names_its_extra(tmp_path: Path, module: str, args: list[str], extra: str) -> None:
    code = WITHOUT.format(module=module, args=[*args, "--data-dir", str(tmp_path / "data")])
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f"pip install 'tinkergym[{extra}]'" in result.stderr and f"tinkergym {args[0]}" in result.stderr


def test_the_extra_follows_the_command() -> None:
    assert missing_extra("fastapi", "scheduler") == "scheduler"
    assert missing_extra("fastapi", "serve") == "serve"
    assert missing_extra("transformers.models", "train") == "train"
    assert missing_extra("transformers", "jobs") == "client"
    assert missing_extra("numpy", "train") is None  # a core dependency: not an extra's, the traceback stays


@pytest.mark.slow
def test_a_client_without_torch_hears_no_advice_to_install_it(tmp_path: Path) -> None:
    code = ("import sys\nsys.modules['torch'] = None\nimport tinkergym.cli\nfrom transformers import AutoTokenizer\n"
            "print(AutoTokenizer.__name__)")
    result = subprocess.run([sys.executable, "-W", "error::DeprecationWarning:tinkergym", "-c", code], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0 and "AutoTokenizer" in result.stdout, result.stderr
    assert "PyTorch was not found" not in result.stderr
