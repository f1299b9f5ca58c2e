"""The ``tinkergym`` command line: listing, info, check, play, help and bad input."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from click.testing import CliRunner

from tinkergym.cli import main


def run(*args: str, input: str | None = None):
    return CliRunner().invoke(main, list(args), input=input, catch_exceptions=False)


def test_envs_list_shows_installed_ids_with_their_facts() -> None:
    result = run("envs", "list")
    assert result.exit_code == 0
    row = next(line for line in result.output.splitlines() if line.startswith("tinker/Bandit-v0"))
    assert row.split()[1:6] == ["tinkergym-bandit", "0.1.0", "free", "single", "1"]
    rows = [json.loads(line) for line in run("envs", "list", "--json").output.splitlines()]
    assert {"id": "tinker/Bandit-v0", "kind": "env"}.items() <= next(r for r in rows if r["id"] == "tinker/Bandit-v0").items()


def test_envs_info_shows_metadata_and_the_env_docstring() -> None:
    result = run("envs", "info", "tinker/Bandit-v0")
    assert result.exit_code == 0
    assert "distribution:      tinkergym-bandit" in result.output
    assert "Reward: 1 with the chosen arm's hidden probability" in result.output


def test_envs_check_passes_and_reports() -> None:
    result = run("envs", "check", "tinker/Bandit-v0", "--fuzz", "20")
    assert result.exit_code == 0, result.output
    assert "ok    tinker/Bandit-v0" in result.output and "1 passed, 0 failed" in result.output


def test_envs_check_times_each_env_and_names_the_slowest_without_the_peers_prints() -> None:
    result = run("envs", "check", "tinker/Bandit-v0", "tinker/GomokuDuel-v0", "--fuzz", "5")
    assert result.exit_code == 0, result.output
    assert re.search(r"^ok    tinker/Bandit-v0  \(\d+\.\d s\)$", result.output, re.MULTILINE), result.output
    assert re.search(r"^ok    tinker/GomokuDuel-v0  \(\d+\.\d s\)$", result.output, re.MULTILINE), result.output
    assert re.search(r"^2 passed, 0 failed in \d+\.\d s; slowest: tinker/\S+ \(", result.output, re.MULTILINE), result.output
    assert "API test" not in result.output  # PettingZoo's api_test prints two lines per env on its own
    assert "env/s" not in result.output  # no bar off a terminal


def test_envs_check_bar_counts_the_envs_on_a_terminal_unless_quiet() -> None:
    from tinkergym.cli.envs import duration, progress_bar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    shown, hidden = Terminal(), Terminal()
    for stream, quiet in ((shown, False), (hidden, True)):
        with progress_bar(2, quiet, file=stream) as bar:
            bar.set_postfix_str("tinker/Slow-v0")
            bar.update(1)
            bar.refresh()
    assert "1/2" in shown.getvalue() and "tinker/Slow-v0" in shown.getvalue() and hidden.getvalue() == ""
    assert [duration(s) for s in (0.42, 12.4, 131.0, 452.0)] == ["0.4 s", "12 s", "2 min 11 s", "7 min 32 s"]
    assert "--quiet" in run("envs", "check", "--help").output


def test_envs_check_fails_with_exit_1_on_a_broken_env(fake_site) -> None:
    fake_site.add(
        "fakeenv-loud",
        {"fake/Loud-v0": "fakeenv_loud:LoudEnv"},
        module_code=(
            "from tinkergym import TextEnv\n"
            "class LoudEnv(TextEnv):\n"
            "    def _reset(self, options):\n        return 'hi', {}\n"
            "    def _step(self, action):\n        return 'beep\\x07', 0.0, True, False, {}\n"
        ),
    )
    result = run("envs", "check", "fake/Loud-v0")
    assert result.exit_code == 1
    assert "FAIL  fake/Loud-v0  (fakeenv-loud, " in result.output and "not inside" in result.output


@pytest.mark.parametrize(
    "args",
    [
        ("envs", "info", "tinker/Nope-v0"),
        ("envs", "check", "tinker/Bandt-v0"),
        ("envs", "check"),
        ("play", "tinker/Bandt-v0"),
        ("play", "--all"),
        ("play", "tinker/Bandit-v0", "--kwarg", "arms"),
        ("play", "tinker/Bandit-v0", "--kwarg", "colour=7", "--agent", "baseline"),
        ("play", "tinker/Bandit-v0", "--seat", "player_3", "--agent", "baseline"),
        ("play", "tinker/Bandit-v0", "--agent", "genius"),
        ("envs", "new", "Bad Name!"),
        ("frobnicate",),
    ],
)
def test_bad_input_is_a_clear_message_and_exit_2(args) -> None:
    result = CliRunner().invoke(main, list(args))
    assert result.exit_code == 2, result.output
    assert "Error" in result.output


def test_unknown_id_message_suggests_the_close_match() -> None:
    result = CliRunner().invoke(main, ["play", "tinker/Bandt-v0"])
    assert "Did you mean: tinker/Bandit-v0" in result.output


@pytest.mark.parametrize("command", [(), ("envs",), ("envs", "list"), ("envs", "info"), ("envs", "check"), ("envs", "new"), ("play",)])
def test_every_command_has_help(command) -> None:
    result = run(*command, "--help")
    assert result.exit_code == 0 and "Usage:" in result.output and len(result.output.splitlines()) > 4


def test_no_help_shows_an_open_range_as_none() -> None:
    """Every command's help, walked from the group: an option without bounds reads as its type, never ``[x<=None]``."""
    import click

    def commands(group: click.Group, path: tuple[str, ...] = ()):
        for name, command in group.commands.items():
            yield (*path, name)
            if isinstance(command, click.Group):
                yield from commands(command, (*path, name))

    for command in commands(main):
        shown = run(*command, "--help").output
        assert "None]" not in shown and "<=None" not in shown, command
    help_text = " ".join(run("train", "--help").output.split())
    assert "--truncated-reward FLOAT Reward given to episodes a budget ended instead of what they collected. --" in help_text
    refused = CliRunner().invoke(main, ["train", "--env", "tinker/Bandit-v0", "--truncated-reward", "nan"])
    assert refused.exit_code == 2 and "nan is not a finite number" in refused.output


def test_play_with_the_baseline_prints_a_transcript_and_writes_jsonl(tmp_path) -> None:
    out = tmp_path / "t.jsonl"
    result = run("play", "tinker/Bandit-v0", "--agent", "baseline", "--seed", "3", "--kwarg", "arms=3", "--jsonl", str(out))
    assert result.exit_code == 0
    assert "[system]" in result.output and "[returns] agent:" in result.output
    record = json.loads(out.read_text())
    assert record["env_id"] == "tinker/Bandit-v0" and record["seed"] == 3 and len(record["turns"]) == 1


def test_a_person_plays_through_stdin() -> None:
    result = run("play", "tinker/Bandit-v0", "--seed", "0", "--kwarg", "reward_mode=\"expected\"", input="green\n")
    assert result.exit_code == 0, result.output
    assert "You pulled the green arm." in result.output and "returns: agent +" in result.output


def _wait_until_blocked(pid: int, seconds: float = 30) -> None:
    """Until process ``pid`` sleeps (state S: here, in the read of the prompt) a few polls in a row."""
    deadline, asleep = time.monotonic() + seconds, 0
    while asleep < 3 and time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as stat:
            asleep = asleep + 1 if stat.read().rsplit(")", 1)[1].split()[0] == "S" else 0
        time.sleep(0.05)


def _sigint_as_a_terminal_gives_it() -> None:
    """In the child before exec: SIGINT neither ignored nor blocked, whatever the parent (a CI runner) set."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_at_the_prompt_abandons_the_game_as_interrupted_and_the_end_of_input_as_ended() -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # A terminal's foreground process gets Ctrl-C; one started in the background of a script inherits SIGINT ignored,
    # so the child gets the terminal's default back before it starts.
    errors = tempfile.TemporaryFile()  # a file, not a pipe: nothing the child writes can fill a buffer and stall it
    process = subprocess.Popen([sys.executable, "-m", "tinkergym", "play", "tinker/Bandit-v0", "--seed", "0"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=errors, env=env,
                               preexec_fn=_sigint_as_a_terminal_gives_it)  # noqa: PLW1509
    try:
        shown, deadline = b"", time.monotonic() + 60
        while b"you>" not in shown:  # the prompt waits for the person's action
            assert time.monotonic() < deadline and process.poll() is None, shown
            shown += os.read(process.stdout.fileno(), 4096)
        # A person presses Ctrl-C while the prompt waits on its read. Sent at once, the signal could land between the
        # prompt's write and its read: Python notes it, the read then blocks, and nothing wakes it (no terminal would).
        _wait_until_blocked(process.pid)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)  # stdin stays open meanwhile, as a terminal's does: Ctrl-C alone ends the game, not the end of input
    finally:
        if process.poll() is None:
            process.kill()
        errors.seek(0)
        stderr = errors.read()
        errors.close()
    assert process.returncode == 130, stderr
    assert b"interrupted: the game is abandoned" in stderr and b"input ended" not in stderr and b"Traceback" not in stderr
    ended = run("play", "tinker/Bandit-v0", "--seed", "0", input="")
    assert ended.exit_code == 1 and "input ended; the game is abandoned" in ended.output


@pytest.mark.slow
def test_play_all_plays_every_installed_env() -> None:
    from tinkergym import list_envs

    result = run("play", "--all", "--agent", "baseline", "--seed", "0", "--max-steps", "300")
    assert result.exit_code == 0, result.output
    for s in list_envs():
        assert f"===== {s.id} " in result.output
