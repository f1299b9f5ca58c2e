"""``tinkergym envs new``: scaffold a pip-installable env package whose tests pass right after generation."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tinkergym.errors import ScaffoldError
from tinkergym.registry.discovery import ENV_ID_PATTERN

_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")
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
    def for_name(cls, name: str, env_id: str | None = None) -> "PackagePlan":
        """Derive the distribution, module, id and class names from a package name like ``wordle``."""
        base = name.lower().removeprefix("tinkergym-").removeprefix("tinkergym_")
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
    if root.exists() and any(root.iterdir()) and not force:
        raise ScaffoldError(f"{root} already exists and is not empty; choose another --dir or pass --force to overwrite.")
    templates = resources.files("tinkergym.registry").joinpath("templates", "package")
    for source, target in _FILES.items():
        text = templates.joinpath(*source.split("/")).read_text(encoding="utf-8")
        path = root / target.format(module=plan.module, short=plan.short)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_render(text, plan), encoding="utf-8")
    return root
