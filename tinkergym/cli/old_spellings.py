"""The command line's old spellings, kept for one release: ``serve-backend``, ``serve-shared``, ``serve-model`` and
``serve-tinker`` (now ``serve backend``, ...) and ``workers list`` (now ``jobs workers``). Each runs its new spelling's
command, with the same options and behaviour, hidden from ``--help``, after one line on stderr that names the new spelling."""

from __future__ import annotations

import click


class OldSpelling(click.Command):
    """``command`` under its old ``name``: its options, callback and help, hidden from help; on use, before its options are
    parsed (so a usage error or ``--help`` says it too), one line on stderr names ``new``, the spelling that replaces ``old``."""

    def __init__(self, name: str, command: click.Command, old: str, new: str, hidden: bool = True) -> None:
        super().__init__(name, context_settings=command.context_settings, callback=command.callback, params=command.params,
                         help=command.help, epilog=command.epilog, short_help=command.short_help,
                         options_metavar=command.options_metavar, add_help_option=command.add_help_option,
                         no_args_is_help=command.no_args_is_help, hidden=hidden)
        self.note = f"tinkergym {old} is deprecated and will be removed in the next release: use `tinkergym {new}`"

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not ctx.resilient_parsing:  # shell completion parses too: it says nothing
            click.echo(self.note, err=True)
        return super().parse_args(ctx, args)


def old_spellings(serve: click.Group, jobs: click.Group) -> list[click.Command]:
    """The hidden top-level commands that keep the old spellings working, made from the ``serve`` and ``jobs`` groups'
    commands (so they cannot drift from them)."""
    aliases: list[click.Command] = [
        OldSpelling(f"serve-{name}", serve.commands[name], f"serve-{name}", f"serve {name}") for name in ("backend", "shared", "model", "tinker")
    ]
    workers = click.Group("workers", hidden=True, help="Deprecated: use `tinkergym jobs workers`.")
    workers.add_command(OldSpelling("list", jobs.commands["workers"], "workers list", "jobs workers", hidden=False))
    aliases.append(workers)
    return aliases
