"""The ``tinkergym`` command line."""

from __future__ import annotations

import importlib.util
import os

import click

from tinkergym.plumbing.folders import PRIVATE_COMMANDS, keep_private
from tinkergym.cli.common import TinkergymGroup
from tinkergym.cli.envs import envs
from tinkergym.cli.jobs import jobs_group
from tinkergym.cli.old_spellings import old_spellings
from tinkergym.cli.play import play
from tinkergym.cli.push import push
from tinkergym.cli.results import results
from tinkergym.cli.scheduler import scheduler_group
from tinkergym.cli.serve import serve_group
from tinkergym.cli.trace import trace
from tinkergym.cli.train import eval_command, train
from tinkergym.cli.worker import worker


def _torch_missing() -> bool:
    try:
        return importlib.util.find_spec("torch") is None
    except (ImportError, ValueError):  # ValueError: blocked in sys.modules
        return True


if _torch_missing():
    # A client install (training through a server or a scheduler) has transformers for the chat template and no torch
    # by design: transformers' advice that "PyTorch was not found" is noise there.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@click.group(cls=TinkergymGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="tinkergym", prog_name="tinkergym")
def main() -> None:
    """tinkergym: a Gym-compatible hub of text environments for training LLM agents.

    \b
    Examples:
      tinkergym envs list
      tinkergym envs check --all
      tinkergym play tinker/Gomoku-v0 --kwarg size=7
      tinkergym play --all --agent baseline

    Exit codes: 0 on success, 2 for bad input (an option, a file's contents, an env's kwargs), 1 when
    the work itself fails (a failed check, a diverged run, a refused upload).
    """
    if click.get_current_context().invoked_subcommand in PRIVATE_COMMANDS:
        keep_private()  # a service's database, logs, secrets and job folders are its owner's alone
    _note_shadowing_folder()


def _note_shadowing_folder() -> None:
    """Say so when a ``tinkergym`` folder here shadows the package for Python run here: the command itself runs the installed
    package, but a script or notebook run here would not, and fail without a word about why."""
    from pathlib import Path

    from tinkergym.registry.shadowing import shadow_note

    try:
        note = shadow_note(Path.cwd())
    except OSError:  # a working directory that is gone
        return
    if note:
        click.echo(note, err=True)


main.add_command(envs)
main.add_command(play)
main.add_command(train)
main.add_command(eval_command)
main.add_command(trace)
main.add_command(results)
main.add_command(push)
main.add_command(jobs_group)
main.add_command(serve_group)
main.add_command(scheduler_group)
main.add_command(worker)
for _old in old_spellings(serve_group, jobs_group):  # hidden; each says which spelling replaces it
    main.add_command(_old)

__all__ = ["main"]
