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


def test_a_background_directive_needs_a_bash_block_and_a_port(tmp_path: Path) -> None:
    with pytest.raises(examples.ConventionError, match="background is for bash blocks"):
        examples.read_blocks(page(tmp_path, "<!-- docs-test: background -->\n```python\nx = 1\n```\n"), "page.md")
    with pytest.raises(examples.ConventionError, match="says its port: background=PORT"):
        examples.read_blocks(page(tmp_path, "<!-- docs-test: background -->\n```bash\npython -m http.server\n```\n"), "page.md")
    with pytest.raises(examples.ConventionError, match="takes a port number"):
        examples.read_blocks(page(tmp_path, "<!-- docs-test: background=http -->\n```bash\ntrue\n```\n"), "page.md")
    (block,) = examples.read_blocks(page(tmp_path, "<!-- docs-test: background=8000 -->\n```bash\npython -m http.server\n```\n"), "page.md")
    assert block.background == 8000
    (block,) = examples.read_blocks(page(tmp_path, "<!-- docs-test: background -->\n```bash\nserve --metrics-port 9101\n```\n"), "page.md")
    run = examples.PageRun(tmp_path, ports={9101: 40001, 80: 40002})
    assert examples.PORT_OPTION.findall(block.code) == ["9101"]
    assert run.code(examples.Block("page.md", tmp_path, 1, "bash", "curl localhost:9101 127.0.0.1:91011 --port=80 :80\n")) == \
        "curl localhost:40001 127.0.0.1:91011 --port=40002 :80\n"


def _run_page(blocks: list[examples.Block], run: examples.PageRun, env: dict[str, str]) -> list[str | None]:
    """Run a page's blocks in order as the docs test does (python chains by their last block), then stop its servers."""
    try:
        return [examples.run_example(examples.python_chain(blocks, block) if block.lang == "python" else [block], run.folder, env, run=run)
                for block in blocks]
    finally:
        run.stop()


@pytest.mark.slow  # a real HTTP server in the background
def test_a_background_server_serves_the_later_blocks_on_a_free_port_and_is_gone_after_the_page(tmp_path: Path) -> None:
    """The server of a background block answers the next blocks (bash and python, its page port moved to a free one in
    both), and its whole process group, a child it forked too, is stopped at the page's end."""
    path = page(tmp_path, """
        <!-- docs-test: background -->
        ```bash
        echo served > index.html
        sleep 300 &   # a child of the block: stopped with it
        echo $! > child.pid
        printf 'import http.server, sys\nhttp.server.test(http.server.SimpleHTTPRequestHandler, port=int(sys.argv[2]), bind="127.0.0.1")\n' > serve.py
        python serve.py --port 8123
        ```

        ```bash
        python -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8123/index.html').read().decode())" > got.txt
        ```

        ```python
        import urllib.request
        assert urllib.request.urlopen("http://localhost:8123/index.html").read() == b"served\\n"
        ```
    """)
    blocks = examples.read_blocks(path, "page.md")
    assert blocks[0].background == 0
    run = examples.PageRun(tmp_path)
    env = examples.example_env(tmp_path / "cache")
    try:
        assert examples.run_example(blocks[:1], tmp_path, env, run=run) is None
        (server,) = run.background
        assert examples.run_example(blocks[1:2], tmp_path, env, run=run) is None
        assert examples.run_example(blocks[2:], tmp_path, env, run=run) is None
    finally:
        run.stop()
    assert (tmp_path / "got.txt").read_text().strip() == "served"
    (port,) = run.ports.values()
    assert port != 8123 and not examples._answers(port)
    assert server.process.returncode is not None and not examples._group_alive(server.process)
    assert not Path(f"/proc/{(tmp_path / 'child.pid').read_text().strip()}").exists()
    assert not run.background


@pytest.mark.slow  # a real process in the background
@pytest.mark.parametrize("code, said", [
    ("echo 'no server here'\nexit 3\n", "exited 3 before 127.0.0.1:"),
    ("echo 'listening soon'\nsleep 300\n", "did not answer on 127.0.0.1:"),
])
def test_a_background_block_that_never_answers_fails_with_its_output_and_the_page_stops(tmp_path: Path, code: str, said: str) -> None:
    path = page(tmp_path, f"<!-- docs-test: background=8124 -->\n```bash\n{code}```\n\n```bash\necho after > after.txt\n```\n")
    first, second = examples.read_blocks(path, "page.md")
    run = examples.PageRun(tmp_path)
    env = examples.example_env(tmp_path / "cache")
    try:
        problem = examples.start_background(first, run, env, timeout=3)
        assert problem is not None and problem.startswith(f"page.md:2: the background example {said}"), problem
        assert "the page's port 8124" in problem and ("no server here" in problem or "listening soon" in problem), problem
        later = examples.run_example([second], tmp_path, env, run=run)
        assert later == "page.md:7: not run: the background example at page.md:2 did not start", later
        assert not (tmp_path / "after.txt").exists()
    finally:
        run.stop()
    assert not run.background


def test_the_variables_a_bash_block_exports_are_seen_by_the_blocks_after_it(tmp_path: Path) -> None:
    path = page(tmp_path, """
        ```bash
        echo tgk_secret > key.txt
        export TINKERGYM_API_KEY=$(cat key.txt)
        export HF_HUB_OFFLINE=0
        LOCAL_ONLY=1
        ```

        ```bash
        test "$TINKERGYM_API_KEY" = tgk_secret
        test "$HF_HUB_OFFLINE" = 0
        test -z "${LOCAL_ONLY:-}"
        export TINKER_API_KEY=tml-$TINKERGYM_API_KEY
        ```

        ```python
        import os
        assert os.environ["TINKER_API_KEY"] == "tml-tgk_secret", os.environ.get("TINKER_API_KEY")
        ```
    """)
    blocks = examples.read_blocks(path, "page.md")
    env = examples.example_env(tmp_path / "cache")
    run = examples.PageRun(tmp_path)
    assert _run_page(blocks, run, env) == [None, None, None]
    assert run.variables == {"TINKERGYM_API_KEY": "tgk_secret", "HF_HUB_OFFLINE": "0", "TINKER_API_KEY": "tml-tgk_secret"}
    alone = examples.run_example([blocks[1]], tmp_path, env)  # without the page's run: nothing carried
    assert alone is not None and "exited 1" in alone, alone
