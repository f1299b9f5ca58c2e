"""Folders written whole or not at all: write into a ``.tmp`` folder, then move it into place.

Readers of checkpoint and export folders skip names ending in ``.tmp``, so an interrupted write never looks
like a finished one. Nothing here imports torch: the training run (client side) and the backends share it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """tinkergym's cache folder: ``$TINKERGYM_CACHE``, else ``~/.cache/tinkergym`` (models, fetched tokenizers, job keys)."""
    root = os.environ.get("TINKERGYM_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "tinkergym"


def write_private_file(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (0600), replacing it atomically (parents are made)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


#: The commands that run a service or write its state (the scheduler and its database, workers, every server): each file
#: they write is the owner's alone (0600 in 0700 folders), whatever the umask they were started under.
PRIVATE_COMMANDS = frozenset({"scheduler", "worker", "serve", "serve-backend", "serve-shared", "serve-tinker", "serve-model"})


def keep_private(folder: str | os.PathLike[str] | None = None) -> None:
    """Make every file this process writes from now on its owner's alone (umask 077: files 0600, folders 0700); with
    ``folder``, also take back from group and others what an older run left readable in it (the folder and the files
    directly inside, links left alone)."""
    os.umask(0o077)
    if folder is None or not os.path.isdir(folder):
        return
    for path in [Path(folder), *Path(folder).iterdir()]:
        info = path.lstat()
        if not path.is_symlink() and info.st_mode & 0o077:
            os.chmod(path, info.st_mode & 0o700)


def plain_relative_parts(path: Any) -> list[str] | None:
    """The parts of ``path`` if it is a plain relative, '/'-separated path (no empty, ``.`` or ``..`` part, no backslash or
    NUL): what a listing sent by another party may name under a folder of ours. Anything else (not a string too): None."""
    parts = path.split("/") if isinstance(path, str) else []
    if not parts or any(p in ("", ".", "..") or "\\" in p or "\0" in p for p in parts):
        return None
    return parts


def fresh_tmp_dir(path: str) -> str:
    """An empty ``path + ".tmp"`` folder (left-overs of an interrupted write are removed)."""
    tmp = os.fspath(path).rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


def replace_dir(tmp: str, path: str) -> None:
    """Move the finished folder ``tmp`` to ``path``, replacing an older ``path`` (a folder cannot be os.replace'd over).

    The older folder is set aside under a ``.tmp`` suffix too, so a reader that skips ``*.tmp`` never sees it.
    """
    old = path + ".old.tmp"
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def complete_checkpoints(folder: Path) -> list[Path]:
    """The checkpoint folders of a run, oldest first, without the ``.tmp`` ones of unfinished writes."""
    found = sorted((folder / "checkpoints").glob("step_*")) if (folder / "checkpoints").is_dir() else []
    return [p for p in found if p.is_dir() and not p.name.endswith(".tmp")]


def latest_checkpoint(folder: Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint of a run folder as (step, path)."""
    found = complete_checkpoints(folder)
    return (int(found[-1].name.split("_")[1]), found[-1]) if found else None
