"""The README's examples show what they say: each `tinkergym play ... --agent baseline` line that claims the baseline
solves its episode is run as written and its episode is answered correctly."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from click.testing import CliRunner

from tinkergym.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"
#: A README line running the scripted baseline with a claim that it solves the episode.
SOLVES = re.compile(r"^(tinkergym play \S+ --agent baseline[^#]*?)\s+#.*\bsolve", re.MULTILINE)


def test_the_readmes_baseline_examples_solve_what_they_say() -> None:
    commands = [match.group(1) for match in SOLVES.finditer(README.read_text(encoding="utf-8"))]
    assert commands, "the README shows the baseline solving an episode"
    for command in commands:
        result = CliRunner().invoke(main, shlex.split(command)[1:])
        assert result.exit_code == 0, (command, result.output)
        assert "Correct." in result.output and "Incorrect." not in result.output, (command, result.output[-800:])
