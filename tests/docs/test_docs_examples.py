"""Every example of README.md and docs/**/*.md does what the page says (the convention: tests/docs/docs_examples.py).

- The pages keep the convention: python and bash blocks only as examples, a reason for every skip, known fixtures.
- Every ``tinkergym ...`` command line of a bash block, skipped or not, parses against the real click tree: its command
  and subcommands exist, its options exist, its values convert (test ids name the page and the fence's line).
- Every python block (with the blocks it continues) and every bash block that is not skipped runs, in a folder of its
  page, offline, with the fixtures it names; a page's examples run in one test process, in order (the slow lane: each
  is a real process, and some train the tiny model; the checks above are the quick lane's). A page's background
  blocks (servers) serve its later blocks and are stopped after its last block, pass or fail.
- A ``tinkergym play ... --agent baseline`` line whose comment says the baseline solves the episode is run, and it does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import docs_examples as examples  # registered by tests/docs/conftest.py
import pytest
from click.testing import CliRunner

from tinkergym.cli import main


def _collect() -> tuple[list[examples.Block], list[str]]:
    blocks, problems = [], []
    for path in examples.pages():
        try:
            blocks += examples.read_blocks(path)
        except examples.ConventionError as exc:
            problems.append(str(exc))
    return blocks, problems


BLOCKS, PROBLEMS = _collect()
BASH = [block for block in BLOCKS if block.lang == "bash"]
COMMANDS = [command for block in BASH for command in examples.command_lines(block)]


def _last_of_each_page(runnable: list[pytest.ParameterSet]) -> dict[str, examples.Block]:
    """The last block each page runs: its servers are stopped after it."""
    return {param.values[0][-1].page: param.values[0][-1] for param in runnable}  # type: ignore[index]


def _runnable() -> list[pytest.ParameterSet]:
    """A parameter per example to run: a bash block, or the last python block of a chain of ``continue`` (it runs them all)."""
    found = []
    for k, block in enumerate(BLOCKS):
        if block.skip:
            continue
        if block.lang == "python":
            following = next((b for b in BLOCKS[k + 1:] if b.page == block.page and b.lang == "python"), None)
            if following is not None and following.continues:
                continue  # the chain's last block runs it
            chain = examples.python_chain(BLOCKS, block)
        else:
            chain = [block]
        found.append(pytest.param(chain, id=chain[0].where, marks=pytest.mark.xdist_group(name=f"docs-{block.page}")))
    return found


def test_the_pages_keep_the_examples_convention() -> None:
    assert not PROBLEMS, "\n".join(PROBLEMS)


def test_the_pages_have_their_command_lines() -> None:
    """The pages' command lines are found (a parser that found none would pass every page)."""
    assert len(COMMANDS) >= 20, [command.text for command in COMMANDS]


@pytest.mark.parametrize("block", BASH, ids=[block.where for block in BASH])
def test_every_command_line_parses(block: examples.Block) -> None:
    wrong = []
    for command in examples.command_lines(block):
        problem = examples.parse_error(command.argv, main)
        if problem:
            wrong.append(f"{command.where}: {command.text}\n    {problem}")
    assert not wrong, "\n".join(wrong)


RUNNABLE = _runnable()
LAST_OF_PAGE = _last_of_each_page(RUNNABLE)


@pytest.fixture(scope="session")
def page_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, examples.PageRun]]:
    """What each page's examples share (one folder per page: a block may use what the blocks before it wrote, exported or
    started); a page's servers still running when the tests end (an interrupted page) are stopped then."""
    runs: dict[str, examples.PageRun] = {}
    yield runs
    for run in runs.values():
        run.stop()


@pytest.mark.slow  # each example is a real process (an interpreter, or bash running tinkergym), and some train a model
@pytest.mark.parametrize("chain", RUNNABLE)
def test_every_example_runs(chain: list[examples.Block], page_runs: dict[str, examples.PageRun], tmp_path_factory: pytest.TempPathFactory,
                            example_fixtures: Callable[[tuple[str, ...]], dict[str, str]], example_cache: Path) -> None:
    page = chain[-1].page
    if page not in page_runs:
        page_runs[page] = examples.PageRun(tmp_path_factory.mktemp("page"))
    run = page_runs[page]
    try:
        fixtures = tuple(dict.fromkeys(name for block in chain for name in block.fixtures))
        problem = examples.run_example(chain, run.folder, examples.example_env(example_cache, example_fixtures(fixtures)), run=run)
    finally:
        if chain[-1] is LAST_OF_PAGE[page]:
            run.stop()
    assert problem is None, problem


def test_the_baseline_examples_solve_what_they_say() -> None:
    """Each ``tinkergym play ... --agent baseline`` line that says the baseline solves its episode runs as written, and the
    episode is answered correctly."""
    claims = [command for command in COMMANDS
              if command.argv[:1] == ["play"] and "baseline" in command.argv and "solve" in command.comment]
    assert claims, "the pages show the baseline solving an episode"
    for command in claims:
        result = CliRunner().invoke(main, command.argv)
        assert result.exit_code == 0, (command.where, command.text, result.output)
        assert "Correct." in result.output and "Incorrect." not in result.output, (command.where, command.text, result.output[-800:])
