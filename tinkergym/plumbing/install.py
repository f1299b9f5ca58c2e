"""The ``pip install`` that gets a missing piece *here*: from the clone this copy of tinkergym runs from, or by its
published name.

tinkergym and its env packages are installed from a clone (``pip install -e .``, ``pip install -e
env_packages/gomoku``) until they are published; a message that says ``pip install 'tinkergym[train]'`` to someone
who works in a clone sends them to an index that may not have it. Every install hint goes through :func:`pip_install`,
which names the clone's own folders when the running package is one (its parent folder holds tinkergym's
``pyproject.toml``) and the published names otherwise.
"""

from __future__ import annotations

import functools
import re
import shlex
from pathlib import Path

#: The folder of tinkergym's own env packages in a clone, by the distribution name's tail (``tinkergym-gomoku``: ``gomoku``).
ENV_PACKAGES = "env_packages"


@functools.cache
def clone_root() -> Path | None:
    """The clone this copy of tinkergym runs from (an editable install), or None (an installed wheel)."""
    root = Path(__file__).resolve().parents[2]
    try:
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return None
    return root if re.search(r'^name\s*=\s*"tinkergym"\s*$', text, re.MULTILINE) else None


def pip_install(extras: str = "", dist: str = "tinkergym") -> str:
    """The command that installs ``dist`` (tinkergym, or one of its env packages such as ``tinkergym-gomoku``) with
    ``extras`` (``"train"``, ``"train,serve"``) here.

    From a clone: ``pip install -e '/path/to/clone[train]'`` or ``pip install -e /path/to/clone/env_packages/gomoku``,
    with the published name after it as what it will be; elsewhere the published name alone.
    """
    published = shlex.quote(f"{dist}[{extras}]" if extras else dist)
    root = clone_root()
    folder = None
    if root is not None and dist == "tinkergym":
        folder = root
    elif root is not None and dist.startswith("tinkergym-"):
        package = root / ENV_PACKAGES / dist.removeprefix("tinkergym-").replace("-", "_")
        folder = package if package.is_dir() else None
    if folder is None:
        return f"pip install {published}"
    local = shlex.quote(f"{folder}[{extras}]" if extras else str(folder))
    return f"pip install -e {local} (from this clone; once published: pip install {published})"
