"""The command line's groups (``serve {backend,shared,model,tinker}``, ``jobs workers``) and the old spellings kept for one
release: each runs as its new spelling does, hidden from ``--help``, after one line on stderr that names the new one."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from tinkergym.cli import main

#: (old spelling, new spelling, arguments that end fast without a server or a scheduler: bad input, exit 2).
SPELLINGS = [
    (["serve-backend"], ["serve", "backend"], ["--model", "tiny", "--run-dir", "{tmp}/run"]),
    (["serve-shared"], ["serve", "shared"], ["--model", "tiny", "--run-dir", "{tmp}/run"]),
    (["serve-model"], ["serve", "model"], ["--model", "tiny"]),
    (["serve-tinker"], ["serve", "tinker"], ["--run-dir", "{tmp}/run", "--data-dir", "{tmp}/data"]),
    (["workers", "list"], ["jobs", "workers"], ["--scheduler", "http://127.0.0.1:9", "--api-key", " "]),
]
IDS = [" ".join(old) for old, _, _ in SPELLINGS]


def invoke(args: list[str]) -> click.testing.Result:
    return CliRunner().invoke(main, args, env={"TINKERGYM_API_KEY": None, "TINKERGYM_SCHEDULER": None})


def note(old: list[str], new: list[str]) -> str:
    return f"tinkergym {' '.join(old)} is deprecated and will be removed in the next release: use `tinkergym {' '.join(new)}`"


def listed(args: list[str]) -> set[str]:
    """The commands ``tinkergym ARGS --help`` lists."""
    shown = invoke([*args, "--help"]).stdout.split("Commands:\n", 1)[1]
    return {line.split()[0] for line in shown.splitlines() if line.startswith("  ") and not line.startswith("   ")}


def test_help_lists_the_groups_and_no_old_spelling() -> None:
    assert listed([]) == {"envs", "eval", "jobs", "play", "push", "results", "scheduler", "serve", "trace", "train", "worker"}
    assert listed(["serve"]) == {"backend", "shared", "model", "tinker"}
    assert listed(["jobs"]) == {"list", "show", "cancel", "logs", "download", "workers"}
    assert listed(["scheduler"]) == {"serve", "keys", "tenants", "workers", "db"}


@pytest.mark.parametrize(("old", "new", "args"), SPELLINGS, ids=IDS)
def test_an_old_spelling_runs_as_the_new_one_after_a_line_naming_it(old: list[str], new: list[str], args: list[str], tmp_path: Path) -> None:
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    now, then = invoke([*new, *args]), invoke([*old, *args])
    assert now.exit_code == 2 and "Error" in now.stderr, now.output  # the arguments are bad input: it ends here, at once
    assert "deprecated" not in now.stderr
    assert then.exit_code == now.exit_code and then.stdout == now.stdout
    first, rest = then.stderr.split("\n", 1)
    assert first == note(old, new)
    assert rest == now.stderr.replace(" ".join(new), " ".join(old))  # a usage line names the spelling it was given


@pytest.mark.parametrize(("old", "new", "args"), SPELLINGS, ids=IDS)
def test_an_old_spelling_takes_the_same_options_and_says_so_on_a_usage_error_too(old: list[str], new: list[str], args: list[str]) -> None:
    for flags in (["--help"], ["--no-such-option"]):
        now, then = invoke([*new, *flags]), invoke([*old, *flags])
        assert then.exit_code == now.exit_code and then.stderr.startswith(note(old, new) + "\n"), then.output
        assert then.stdout.replace(" ".join(old), " ".join(new)) == now.stdout


def test_the_old_servers_keep_their_options() -> None:
    """Every old spelling is the same command: the same options, the same callback."""
    serve = main.commands["serve"]
    assert isinstance(serve, click.Group)
    for name in ("backend", "shared", "model", "tinker"):
        old, new = main.commands[f"serve-{name}"], serve.commands[name]
        assert old.hidden and not new.hidden
        assert old.callback is new.callback and [p.name for p in old.params] == [p.name for p in new.params]
