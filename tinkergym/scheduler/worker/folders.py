"""What a worker keeps on disk per job, bounded. Standard library only.

- While a job runs, its server's saved states (``states/<name>``) that are uploaded and recorded as checkpoints are
  pruned to the newest ``keep`` (``tinkergym worker --keep-states``, 2; 0 keeps all): the scheduler's artifact store
  holds every one, and a state not yet uploaded, or the one an inference server serves, is never removed.
- When a job ends, its folder (``jobs/<job>/<epoch>/``) goes: at once when the job ended normally, was lost or the
  worker stopped; when it failed, or the worker gave it back, only its server's log (``server.out``, its last
  :data:`KEPT_LOG_BYTES`) stays for debugging, and only for the newest :data:`KEPT_FAILED` such jobs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

STEP_NAME = re.compile(r"^step_(\d{1,12})(?:\.p\d{1,2})?$")  # a league player's state: step_N.p<i>
#: A league player's state of a checkpoint: ``<checkpoint>.p<i>`` (``tinkergym.backends.scheduled.ScheduledPlayer``).
PLAYER_STATE = re.compile(r"^(.+)\.p(\d{1,2})$")
#: Server log bytes kept of a failed job, and how many failed jobs' logs a worker keeps.
KEPT_LOG_BYTES = 1 << 20
KEPT_FAILED = 20
#: Outcomes whose folder keeps the server's log.
KEEP_LOG = ("failed", "released")


def state_step(name: str, folder: Path) -> int | None:
    """A state folder's step: from its name ``step_NNNNNN``, else ``state.json``'s ``step``; None when neither says."""
    match = STEP_NAME.match(name)
    if match:
        return int(match.group(1))
    try:
        step = json.loads((folder / "state.json").read_text(encoding="utf-8")).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def state_files(folder: Path) -> list[str]:
    """Relative paths of the regular files in a state folder (hidden names and symlinks skipped)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and not os.path.islink(os.path.join(dirpath, d)))
        for filename in sorted(filenames):
            path = os.path.join(dirpath, filename)
            if not filename.startswith(".") and os.path.isfile(path) and not os.path.islink(path):
                found.append(os.path.relpath(path, folder).replace(os.sep, "/"))
    return found


def prune_states(states: Path, uploaded: set[str], keep: int, protect: set[str]) -> list[str]:
    """Remove the uploaded states in ``states`` past the newest ``keep`` (by step, then name), never one of ``protect``;
    the names removed."""
    if keep <= 0:
        return []
    present = [(state_step(name, states / name) or 0, name) for name in uploaded
               if name not in protect and (states / name).is_dir() and not (states / name).is_symlink()]
    removed = []
    for _, name in sorted(present, reverse=True)[keep:]:
        shutil.rmtree(states / name, ignore_errors=True)
        removed.append(name)
    return removed


def finish_folder(folder: Path, outcome: str) -> None:
    """Clean the ended job's folder for ``outcome`` (see the module's notes)."""
    if outcome not in KEEP_LOG:
        shutil.rmtree(folder, ignore_errors=True)
        try:
            folder.parent.rmdir()  # jobs/<job>/, when no other epoch's folder is left
        except OSError:
            pass
        return
    log = folder / "server.out"
    for entry in list(folder.iterdir()) if folder.is_dir() else []:
        if entry != log:
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() and not entry.is_symlink() else entry.unlink(missing_ok=True)
    if log.is_file() and log.stat().st_size > KEPT_LOG_BYTES:
        with open(log, "rb") as handle:
            handle.seek(-KEPT_LOG_BYTES, os.SEEK_END)
            tail = handle.read()
        log.write_bytes(tail)
    _prune_failed(folder.parent.parent)


def _prune_failed(jobs: Path) -> None:
    """Keep the newest :data:`KEPT_FAILED` ended jobs' folders (those holding only their log) under ``jobs``."""
    ended = []
    for epoch in jobs.glob("*/*"):
        try:
            if epoch.is_dir() and os.listdir(epoch) == ["server.out"]:
                ended.append((epoch.stat().st_mtime, epoch))
        except OSError:
            continue
    for _, epoch in sorted(ended, reverse=True)[KEPT_FAILED:]:
        shutil.rmtree(epoch, ignore_errors=True)
        try:
            epoch.parent.rmdir()
        except OSError:
            pass
