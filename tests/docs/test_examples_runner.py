"""The examples' runner itself (tests/docs/docs_examples.py), on pages written here: it fails a page whose command line has a
wrong option, a missing command or a bad value, and a python block that fails, naming the page and the line; it refuses a
skip without a reason; and it reads what shells read (continuations, comments, variables, ``$(...)``, pipes, ``&&``)."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import docs_examples as examples  # registered by tests/docs/conftest.py
import pytest

from tinkergym.cli import main


def page(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(textwrap.dedent(text).lstrip(), encoding="utf-8")
    return path


def problems(path: Path) -> list[str]:
    """What the runner says is wrong with the command lines of the page at ``path``: ``PAGE:LINE: COMMAND`` and why."""
    return [f"{command.where}: {command.text}: {problem}"
            for block in examples.read_blocks(path, "page.md") if block.lang == "bash"
            for command in examples.command_lines(block)
            if (problem := examples.parse_error(command.argv, main))]


def test_a_wrong_flag_a_missing_command_and_a_bad_value_fail_with_the_page_and_line(tmp_path: Path) -> None:
    path = page(tmp_path, """
        # A page

        ```bash
        tinkergym envs list
        tinkergym envs list --no-such-flag
        ```

        Text between.

        <!-- docs-test: skip: parsed, never run -->
        ```bash
        tinkergym no-such-command --help
        tinkergym play tinker/Bandit-v0 --seed many
        ```
    """)
    found = problems(path)
    assert len(found) == 3, found
    assert found[0].startswith("page.md:5: tinkergym envs list --no-such-flag:") and "--no-such-flag" in found[0], found
    assert found[1].startswith("page.md:12: tinkergym no-such-command --help:") and "no-such-command" in found[1], found
    assert found[2].startswith("page.md:13: tinkergym play tinker/Bandit-v0 --seed many:") and "many" in found[2], found


def test_shell_syntax_is_read_as_a_shell_reads_it(tmp_path: Path) -> None:
    """Continuations, comments, variables, ``$(...)`` (its inner command checked too), pipes, ``&&``, ``python -m``."""
    path = page(tmp_path, """
        ```bash
        export TINKERGYM_API_KEY=$(tinkergym envs lisst)   # the inner command is checked
        SEED=3 tinkergym play tinker/Bandit-v0 \\
            --agent baseline --seed "$SEED" | tail -n 3 && echo done  # --seed's value is computed
        tinkergym envs list --json > envs.json 2>&1; python -m tinkergym envs info tinker/Bandit-v0 --bogus
        ```
    """)
    blocks = examples.read_blocks(path, "page.md")
    commands = examples.command_lines(blocks[0])
    assert [c.argv for c in commands] == [
        ["envs", "lisst"],
        ["play", "tinker/Bandit-v0", "--agent", "baseline", "--seed", examples.DYNAMIC],
        ["envs", "list", "--json"],
        ["envs", "info", "tinker/Bandit-v0", "--bogus"],
    ], commands
    assert commands[1].where == "page.md:3" and "seed's value is computed" in commands[1].comment
    found = problems(path)
    assert len(found) == 2 and "lisst" in found[0] and "--bogus" in found[1], found


def test_a_failing_python_block_fails_with_its_page_and_line(tmp_path: Path) -> None:
    path = page(tmp_path, """
        ```python
        numbers = [1, 2, 3]
        ```

        <!-- docs-test: continue -->
        ```python
        assert sum(numbers) == 6
        print(numbers[7])
        ```
    """)
    blocks = examples.read_blocks(path, "page.md")
    assert blocks[1].continues and examples.python_chain(blocks, blocks[1]) == blocks
    problem = examples.run_example(blocks, tmp_path, examples.example_env(tmp_path / "cache"))
    assert problem is not None and problem.startswith("page.md:6: the python example"), problem
    assert f'File "{path}", line 8' in problem and "IndexError" in problem, problem
    assert examples.run_example(blocks[:1], tmp_path, examples.example_env(tmp_path / "cache")) is None


def test_a_bash_block_runs_with_the_venv_first_on_path_and_fails_on_any_command(tmp_path: Path) -> None:
    path = page(tmp_path, """
        ```bash
        tinkergym envs list | grep tinker/Bandit-v0 > /dev/null
        test "$HF_HUB_OFFLINE" = 1
        ```

        ```bash
        false | cat
        echo never
        ```
    """)
    good, bad = examples.read_blocks(path, "page.md")
    env = examples.example_env(tmp_path / "cache")
    assert examples.run_example([good], tmp_path, env) is None
    problem = examples.run_example([bad], tmp_path, env)
    assert problem is not None and problem.startswith("page.md:6: the bash example exited 1") and "never" not in problem, problem


@pytest.mark.parametrize("directive, refusal", [
    ("skip", "a skip needs its reason"),
    ("skip:   ", "a skip needs its reason"),
    ("fixture=gpu-cluster", "no fixture 'gpu-cluster'"),
    ("runme", "unknown directive"),
])
def test_a_directive_that_says_too_little_is_refused(tmp_path: Path, directive: str, refusal: str) -> None:
    path = page(tmp_path, f"""
        <!-- docs-test: {directive} -->
        ```bash
        tinkergym envs list
        ```
    """)
    with pytest.raises(examples.ConventionError, match=refusal):
        examples.read_blocks(path, "page.md")


@pytest.mark.parametrize("text, refusal", [
    ("<!-- docs-test: skip: slow -->\n\n```bash\ntrue\n```\n", "just above a fence"),
    ("```sh\ntinkergym envs list\n```\n", "write ```bash"),
    ("<!-- docs-test: continue -->\n```python\nx = 1\n```\n", "continue follows a python block"),
    ("<!-- docs-test: skip: output -->\n```text\nhello\n```\n", "not ```text"),
])
def test_examples_that_would_escape_the_checks_are_refused(tmp_path: Path, text: str, refusal: str) -> None:
    with pytest.raises(examples.ConventionError, match=refusal):
        examples.read_blocks(page(tmp_path, text), "page.md")


def test_directives_stack_and_skipped_blocks_are_still_parsed(tmp_path: Path) -> None:
    path = page(tmp_path, """
        <!-- docs-test: fixture=tiny-model -->
        <!-- docs-test: fixture=scheduler -->
        ```bash
        tinkergym jobs list
        ```

        <!-- docs-test: skip: needs a GPU -->
        ```bash
        tinkergym train --env tinker/Bandit-v0 --steps one
        ```
    """)
    first, second = examples.read_blocks(path, "page.md")
    assert first.fixtures == ("tiny-model", "scheduler") and first.skip is None
    assert second.skip == "needs a GPU"
    found = problems(path)
    assert len(found) == 1 and found[0].startswith("page.md:9:") and "one" in found[0], found


@pytest.mark.slow  # a real scheduler and a tinkergym process
def test_a_block_with_the_scheduler_and_tiny_model_fixtures_reaches_them(tmp_path: Path, example_fixtures: Any) -> None:
    """``fixture=scheduler`` is a running scheduler whose tenant key lists its (no) jobs; ``fixture=tiny-model`` a model folder."""
    path = page(tmp_path, """
        <!-- docs-test: fixture=scheduler -->
        <!-- docs-test: fixture=tiny-model -->
        ```bash
        tinkergym jobs list --json > jobs.json
        python -c "import json; assert json.load(open('jobs.json')) == [], open('jobs.json').read()"
        test -f "$TINY_MODEL/config.json"
        ```
    """)
    (block,) = examples.read_blocks(path, "page.md")
    env = examples.example_env(tmp_path / "cache", example_fixtures(block.fixtures))
    assert env["TINKERGYM_URL"].startswith("http://127.0.0.1:") and env["TINKERGYM_API_KEY"]
    assert examples.run_example([block], tmp_path, env) is None
    env["TINKERGYM_API_KEY"] = "tgk_not-a-key"
    problem = examples.run_example([block], tmp_path, env)
    assert problem is not None and "page.md:3: the bash example exited" in problem, problem
