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


def _help(words: tuple[str, ...], cache: dict[tuple[str, ...], str | None]) -> str | None:
    if words not in cache:
        result = CliRunner().invoke(main, [*words, "--help"])
        cache[words] = result.output if result.exit_code == 0 else None
    return cache[words]


def test_every_readme_command_line_names_a_command_and_options_that_exist() -> None:
    """Each `tinkergym ...` line of the README's shell blocks names a real (sub)command, and each --option on it is one
    that command's --help lists: an example copied from the README never fails with "no such option"."""
    cache: dict[tuple[str, ...], str | None] = {}
    checked, wrong = 0, []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = line.split(" #")[0]
            found = re.search(r"(?:^|[\s)])tinkergym ((?:[a-z][a-z-]* ?)+)(.*)", line)
            if found is None or "torchrun" in line:  # torchrun's own options come before the command
                continue
            words = tuple(found.group(1).split())
            command = next((words[:n] for n in range(len(words), 0, -1) if _help(words[:n], cache) is not None), None)
            if command is None:
                wrong.append(f"no such command: {line.strip()}")
                continue
            checked += 1
            wrong += [f"{' '.join(command)} has no {option}: {line.strip()}"
                      for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", found.group(2)) if option not in (_help(command, cache) or "")]
    assert checked > 50, checked  # the README's command lines were found
    assert not wrong, "\n".join(wrong)
