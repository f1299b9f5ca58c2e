"""Folders written whole or not at all: write into a ``.tmp`` folder, then move it into place.

Readers of checkpoint and export folders skip names ending in ``.tmp``, so an interrupted write never looks
like a finished one. Nothing here imports torch: the training run (client side) and the backends share it.
"""

from __future__ import annotations

import os
import shutil


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
