"""Shared pieces of the CLI commands: the error handling of the command group, path and seed options, ``--kwarg`` parsing."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

import click

from tinkergym.errors import ConfigError, EnvKindError, ScaffoldError, TinkergymError, UnknownEnvError
from tinkergym.plumbing.install import pip_install

#: tinkergym errors that mean the input was wrong (an option, a file's contents, an env's kwargs): exit code 2.
INPUT_ERRORS = (ConfigError, UnknownEnvError, EnvKindError, ScaffoldError)

#: The seeds every command accepts: what NumPy's legacy seeding (and so every backend) takes.
SEED = click.IntRange(0, 2**32 - 1)

#: Longest message shown for a library error (a hostile value quoted in full could fill the terminal).
MAX_MESSAGE = 2_000


def shorten(text: str, limit: int = 300) -> str:
    """``text``, or its start and end around a note of what was cut when it is longer than ``limit``; the end says what went wrong."""
    if len(text) <= limit:
        return text
    keep = (limit - 40) // 2
    return f"{text[:keep]} ... ({len(text) - 2 * keep:,} characters) ... {text[-keep:]}"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """``header`` over ``rows`` in left-aligned columns two spaces apart, without trailing spaces."""
    lines = [header, *rows]
    widths = [max(len(str(r[i])) for r in lines) for i in range(len(header))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in lines)


def when(t: float | None) -> str:
    """``2025-01-02 03:04:05Z``: a time stamp in UTC, for a table; ``-`` for none."""
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


def age(created_at: float, now: float | None = None) -> str:
    """``42s``, ``5m``, ``3h``, ``2d``: how long ago ``created_at`` was."""
    seconds = max(0.0, (time.time() if now is None else now) - created_at)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def _shown(exc: Exception) -> str:
    """The message of ``exc``, shortened to :data:`MAX_MESSAGE` characters."""
    return shorten(str(exc), MAX_MESSAGE)


class InputError(click.ClickException):
    """Bad input found after option parsing: its message alone, with click's usage-error exit code 2."""

    exit_code = 2


#: The extra that installs a module a command imports (the top-level package name), by the command's first word where
#: the module belongs to more than one extra.
_EXTRAS: dict[str, str] = {
    "sqlalchemy": "scheduler", "alembic": "scheduler", "psycopg": "scheduler", "httpx": "scheduler",
    "fastapi": "serve", "uvicorn": "serve", "httptools": "serve", "starlette": "serve",
    "torch": "train", "peft": "train", "accelerate": "train", "safetensors": "train", "gguf": "train", "openskill": "train",
    "transformers": "client", "tokenizers": "client", "jinja2": "client", "tqdm": "client", "yaml": "client",
    "matplotlib": "client", "tensorboardX": "client", "huggingface_hub": "hub", "vllm": "vllm", "trl": "bench",
}
_COMMAND_EXTRAS = {"scheduler": {"serve": "scheduler", "client": "scheduler"}, "train": {"client": "train"},
                   "serve": {"client": "serve"}, "serve-backend": {"client": "serve"}, "serve-model": {"client": "serve"},
                   "push": {"client": "hub"}}


def missing_extra(module: str | None, command: str | None) -> str | None:
    """The extra of tinkergym that installs ``module`` for ``command`` (its first word); None for a module of none."""
    extra = _EXTRAS.get((module or "").split(".")[0])
    return _COMMAND_EXTRAS.get(command or "", {}).get(extra or "", extra) if extra else None


class TinkergymGroup(click.Group):
    """A command group that shows tinkergym's errors as messages, never tracebacks: bad input exits 2, other failures 1;
    a module that is not installed names the extra that installs it."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ModuleNotFoundError as exc:
            command = ctx.invoked_subcommand
            extra = missing_extra(exc.name, command)
            if extra is None:
                raise
            what = f"tinkergym {command}" if command else "this command"
            raise click.ClickException(
                f"{what} needs the {extra!r} extra (no module named {exc.name!r}): install it with: {pip_install(extra)}"
            ) from exc
        except INPUT_ERRORS as exc:
            raise InputError(_shown(exc)) from exc
        except TinkergymError as exc:
            if getattr(exc, "input_error", False):  # a service refused the request itself (a bad key, a bad argument)
                raise InputError(_shown(exc)) from exc
            raise click.ClickException(_shown(exc)) from exc


class SafePath(click.Path):
    """``click.Path`` that refuses a NUL byte with a usage error (the OS calls behind its checks raise ValueError)."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and "\0" in value:
            self.fail(f"{shorten(repr(value))} contains a NUL byte, which no path may hold.", param, ctx)
        return super().convert(value, param, ctx)


class FiniteFloat(click.FloatRange):
    """``click.FloatRange`` that also refuses ``nan`` and ``inf`` (which compare false against any bound).

    Without bounds it is shown in help as a plain ``FLOAT``, with no range (click would show ``[x<=None]``).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.min is None and self.max is None:
            self.name = "float"

    def _describe_range(self) -> str:
        return "" if self.min is None and self.max is None else super()._describe_range()

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{number} is not a finite number.", param, ctx)
        return number


def writable_file(path: Path | None, option: str) -> Path | None:
    """Check before any work is done that ``path`` can be written (its folder is created); a usage error names ``option``."""
    if path is None:
        return None
    try:
        if path.is_dir():
            raise click.BadParameter(f"{shorten(str(path))!r} is a folder; give a file name.", param_hint=option)
        path.parent.mkdir(parents=True, exist_ok=True)
        writable = os.access(path.parent, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))
    except OSError as exc:  # no permission, a name too long, a file where a folder should be
        raise click.BadParameter(f"cannot write {shorten(str(path))!r}: {exc.strerror or exc}.", param_hint=option) from exc
    if not writable:
        raise click.BadParameter(f"{shorten(str(path))!r} is not writable.", param_hint=option)
    return path


def save_transcripts(out: Path | None, trajectories: list[Any], env: str) -> None:
    """Write an evaluation's transcripts to ``out`` (when given); a file that cannot be written is a clear error."""
    if out is None:
        return
    from tinkergym.trainers.evaluation import write_transcripts

    try:
        write_transcripts(out, trajectories, env=env)
    except OSError as exc:
        raise click.ClickException(f"cannot write the transcripts to {out}: {exc.strerror or exc}.") from exc


def construct_env(make: Callable[..., Any], env_id: str, kwargs: dict[str, Any]) -> Any:
    """``make(env_id, **kwargs)`` (``make`` is :func:`tinkergym.make` or :func:`tinkergym.make_aec`), bad kwargs as :class:`ConfigError`."""
    from tinkergym.registry import make_aec, make_checked

    return make_checked(env_id, kwargs, multi_agent=make is make_aec)


def parse_kwargs(pairs: tuple[str, ...], option: str = "--kwarg") -> dict[str, Any]:
    """``("size=7", "opponent=random")`` -> ``{"size": 7, "opponent": "random"}`` (values read as JSON when they parse);
    a pair that is not KEY=VALUE is a usage error that names ``option``."""
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.isidentifier():
            raise click.BadParameter(f"{pair!r}: expected KEY=VALUE, e.g. size=7", param_hint=option)
        try:
            kwargs[key] = json.loads(raw)
        except (json.JSONDecodeError, RecursionError):
            kwargs[key] = raw
    return kwargs


def env_ids_argument(required: bool = False):
    """A variadic ENV_ID argument."""
    return click.argument("env_ids", nargs=-1, required=required, metavar="ENV_ID...")
