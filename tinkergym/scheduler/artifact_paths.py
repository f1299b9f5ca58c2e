"""The rule that keeps an artifact's file inside its checkpoint folder, shared by the store and the worker.

The scheduler's :class:`~tinkergym.scheduler.artifacts.DirectoryStore` checks every path a worker uploads with
:func:`check_relpath`; a worker checks every path of a listing it restores with the same function, so a file
lands inside the job's folder whatever a scheduler (or whoever answers in its place) lists. Lengths are counted
in UTF-8 bytes, as file systems count them (255 bytes a component on ext4, XFS and most others).
"""

from __future__ import annotations

import re

#: Bytes of a whole relative path, and of one of its components, at most.
MAX_PATH_BYTES = 1024
MAX_COMPONENT_BYTES = 255
#: A checkpoint's folder name (``step_000012``): one plain path component, recorded by the scheduler, kept by the worker.
CHECKPOINT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


class ArtifactPathError(ValueError):
    """A job id, checkpoint name or file path that could leave the job's folder, or is not allowed (HTTP 400)."""


def check_relpath(relpath: str) -> list[str]:
    """The components of a relative file path, or :class:`ArtifactPathError` for anything that could escape or hide.

    ``/``-separated components, none empty, ``.`` or ``..``, none starting with ``.`` (the store's own temporary
    and digest files do), none holding a backslash, a NUL, a control character or a lone surrogate, at most
    :data:`MAX_COMPONENT_BYTES` bytes each and :data:`MAX_PATH_BYTES` in all.
    """
    if not isinstance(relpath, str) or not relpath:
        raise ArtifactPathError(f"a file path of 1 to {MAX_PATH_BYTES} bytes is needed")
    if relpath.startswith("/") or "\\" in relpath or "\0" in relpath:
        raise ArtifactPathError(f"file path {relpath[:100]!r}: relative, '/'-separated, no backslash or NUL")
    parts = relpath.split("/")
    for part in parts:
        if part in ("", ".", "..") or part.startswith(".") or not part.isprintable():  # lone surrogates are not printable
            raise ArtifactPathError(f"file path {relpath[:100]!r}: no empty, '.', '..' or hidden component, no control characters")
        if len(part.encode("utf-8")) > MAX_COMPONENT_BYTES:
            raise ArtifactPathError(f"file path {relpath[:100]!r}: a component of more than {MAX_COMPONENT_BYTES} bytes (UTF-8)")
    if len(relpath.encode("utf-8")) > MAX_PATH_BYTES:
        raise ArtifactPathError(f"file path {relpath[:100]!r}...: more than {MAX_PATH_BYTES} bytes (UTF-8)")
    return parts
