"""Click options made from a config dataclass's fields, and a command whose help shows its options in sections.

Each option's name, type, default, help and bounds come from its field and the field's
:class:`~tinkergym.config.Setting`, so they are written once, on the field: a field with a Setting is an option, a
changed default shows in ``--help``. The option's default is the field's; what the command line gave is told apart from a
default by the parameter's source (:func:`given`), so an option left out never overrides a config file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, fields
from typing import Any

import click
from click.core import ParameterSource

from tinkergym.cli.common import FiniteFloat
from tinkergym.config import SECTIONS, Setting, setting_of


class SectionOption(click.Option):
    """A click option that belongs to a section of its command's help (:class:`SectionedCommand`)."""

    def __init__(self, *args: Any, section: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.section = section


def option(section: str, *param_decls: str, **attrs: Any) -> Callable[[Any], Any]:
    """``click.option`` whose option is listed under ``section`` in the help."""
    return click.option(*param_decls, cls=SectionOption, section=section, **attrs)


#: Widest option name whose help starts on its line (click's own bound); a longer one has its help on the next line.
_TERM_WIDTH = 30


class SectionedCommand(click.Command):
    """A command whose help lists its options by section: those of :data:`~tinkergym.config.SECTIONS` in that order,
    then any other, then the options of no section (``--help``) under ``Options``."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        groups: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                groups.setdefault(getattr(param, "section", None) or "Options", []).append(record)
        order = [*SECTIONS, *(name for name in groups if name not in SECTIONS and name != "Options"), "Options"]
        width = min(max(len(term) for rows in groups.values() for term, _ in rows), _TERM_WIDTH)
        for name in order:
            if name in groups:  # every section's help starts in the same column
                with formatter.section(name):
                    formatter.write_dl([(term.ljust(width), text) for term, text in groups[name]], col_max=width)


def setting_options(config_class: type) -> list[click.Option]:
    """One option for each field of the dataclass ``config_class`` that the command line sets, in the fields' order."""
    return [setting_option(f) for f in fields(config_class) if (found := setting_of(f)) is not None and found.option is not None]


def setting_option(f: Field[Any]) -> click.Option:
    """The option of field ``f`` (parameter name: the field's name): its type from the field's annotation and bounds,
    its default the field's (shown in the help unless it is empty), its help and metavar the field's."""
    found = setting_of(f)
    if found is None or found.option is None:
        raise ValueError(f"config field {f.name!r} has no command-line option: give it a Setting with an option name.")
    name = found.option or "--" + f.name.replace("_", "-")
    annotation = _annotation(f)
    shared: dict[str, Any] = {"section": found.section, "help": found.help, "metavar": found.metavar}
    if annotation.startswith("dict"):  # a mapping, given as KEY=VALUE pairs (repeatable) that add to the file's
        return SectionOption([name, f.name], multiple=True, **{**shared, "metavar": found.metavar or "KEY=VALUE"})
    default = f.default if f.default is not MISSING else None
    if annotation == "bool":  # a flag that turns the setting on
        return SectionOption([name, f.name], is_flag=True, default=bool(default), **shared)
    if annotation == "bool | None":  # on, off, or left to the platform
        return SectionOption([f"{name}/--no-{name.removeprefix('--')}", f.name], default=None, **shared)
    shown = not (default is None or default == "")
    return SectionOption([name, f.name], type=_click_type(f.name, annotation, found), default=default, show_default=shown, **shared)


def _annotation(f: Field[Any]) -> str:
    """The field's type as text (``int``, ``float | None``, ``dict[str, Any]``), whether or not annotations are postponed."""
    kind = f.type
    if isinstance(kind, str):
        return kind
    return kind.__name__ if isinstance(kind, type) else str(kind)


def _click_type(name: str, annotation: str, found: Setting) -> click.ParamType:
    """The click type of a field of type ``annotation``: its choices, or a number type within its bounds."""
    if found.choices:
        return click.Choice(list(found.choices))
    if annotation == "int":
        if found.min is None and found.max is None:
            return click.INT
        low, high = (None if bound is None else int(bound) for bound in (found.min, found.max))
        return click.IntRange(low, high, min_open=found.min_open, max_open=found.max_open)
    if annotation in ("float", "float | None"):
        return FiniteFloat(found.min, found.max, min_open=found.min_open, max_open=found.max_open)
    if annotation in ("str", "str | None"):
        return click.STRING
    raise TypeError(f"config field {name!r} of type {annotation} has no command-line type; give it int, float, str, bool or dict.")


def given(options: dict[str, Any], params: Iterable[click.Parameter]) -> dict[str, Any]:
    """``options`` (the current command's) without those of ``params`` that the command line left at their defaults."""
    ctx = click.get_current_context()
    left_out = {p.name for p in params if p.name and ctx.get_parameter_source(p.name) in (ParameterSource.DEFAULT, None)}
    return {k: v for k, v in options.items() if k not in left_out}
