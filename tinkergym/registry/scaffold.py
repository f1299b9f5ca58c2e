"""``tinkergym envs new``: scaffold a pip-installable env package whose tests pass right after generation."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tinkergym.errors import ScaffoldError
from tinkergym.registry.discovery import ENV_ID_PATTERN

_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")
#: Longest package name: the folder tinkergym-NAME and the files in it stay well inside every file system's limits.
MAX_NAME_LENGTH = 64
#: Template file -> path inside the new package ({module} is replaced by the import name).
_FILES = {
    "pyproject.toml.tmpl": "pyproject.toml",
    "README.md.tmpl": "README.md",
    "init.py.tmpl": "{module}/__init__.py",
    "env.py.tmpl": "{module}/env.py",
    "agents.py.tmpl": "{module}/agents.py",
    "tinkergym_envs.toml.tmpl": "{module}/tinkergym_envs.toml",
    "tests/test_env.py.tmpl": "tests/test_{short}_env.py",
}


@dataclass(frozen=True)
class PackagePlan:
    """The names one scaffold uses."""

    name: str
    dist: str
    module: str
    short: str
    env_id: str
    class_name: str

    @classmethod
    def for_name(cls, name: str, env_id: str | None = None) -> PackagePlan:
        """Derive the distribution, module, id and class names from a package name like ``wordle``."""
        base = name.lower().removeprefix("tinkergym-").removeprefix("tinkergym_")
        if len(base) > MAX_NAME_LENGTH:
            raise ScaffoldError(f"the package name is {len(base)} characters long, too long: use at most {MAX_NAME_LENGTH} (e.g. 'wordle').")
        if not _NAME.match(base):
            raise ScaffoldError(
                f"{name!r} is not a usable package name: use lowercase letters, digits and single dashes, "
                "starting with a letter (e.g. 'wordle' or 'maze-runner')."
            )
        short = base.replace("-", "_")
        camel = "".join(part.capitalize() for part in re.split(r"[-_]", base))
        env_id = env_id or f"{short}/{camel}-v0"
        match = ENV_ID_PATTERN.match(env_id)
        if not match or not match.group("version") or not match.group("namespace"):
            raise ScaffoldError(f"--id {env_id!r} must look like 'namespace/Name-v0'.")
        return cls(base, f"tinkergym-{base}", f"tinkergym_{short}", short, env_id, f"{camel}Env")


def _render(text: str, plan: PackagePlan) -> str:
    for key in ("name", "dist", "module", "short", "env_id", "class_name"):
        text = text.replace("{{" + key + "}}", getattr(plan, key))
    return text


def scaffold_package(name: str, parent: Path, env_id: str | None = None, force: bool = False) -> Path:
    """Write a new env package ``tinkergym-<name>`` under ``parent``; return its folder."""
    plan = PackagePlan.for_name(name, env_id)
    root = Path(parent) / plan.dist
    _check_target(Path(parent), root, force)
    templates = resources.files("tinkergym.registry").joinpath("templates").joinpath("package")
    for source, target in _FILES.items():
        text = templates.joinpath(*source.split("/")).read_text(encoding="utf-8")
        path = root / target.format(module=plan.module, short=plan.short)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_render(text, plan), encoding="utf-8")
        except OSError as exc:
            raise ScaffoldError(f"cannot write {path}: {exc.strerror or exc}; choose another --dir.") from exc
    return root


def _check_target(parent: Path, root: Path, force: bool) -> None:
    """Refuse, before anything is written, a package folder that cannot be created or that holds files (unless ``force``)."""
    try:
        if parent.exists() and not parent.is_dir():
            raise ScaffoldError(f"--dir {parent} is a file, not a folder; choose a folder to create the package in.")
        if root.exists() and not root.is_dir():
            raise ScaffoldError(f"{root} is a file, not a folder; move it away or choose another --dir (--force only overwrites a folder).")
        root.mkdir(parents=True, exist_ok=True)
        occupied = any(root.iterdir())
    except OSError as exc:  # no permission, a name too long, a read-only file system
        raise ScaffoldError(f"cannot create {root}: {exc.strerror or exc}; choose another --dir.") from exc
    if occupied and not force:
        raise ScaffoldError(f"{root} already exists and is not empty; choose another --dir or pass --force to overwrite.")
