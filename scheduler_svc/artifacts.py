"""The artifact store: each job's checkpoints as files, behind a small interface an object store can implement later.

:class:`ArtifactStore` is the interface (``open_upload``/``put_file``, ``open_file``, ``list_files``, ``delete``);
:class:`DirectoryStore` keeps ``<data_dir>/jobs/<job id>/<checkpoint name>/<relative path>`` on the scheduler's
disk. Paths can never leave the job's folder:

- a job id is ``job_<hex>`` and a checkpoint name one path component
  (:data:`tinkergym.scheduler.leases.CHECKPOINT_NAME`);
- a relative file path is ``/``-separated components, none empty, ``.`` or ``..``, none holding a backslash,
  a NUL or a control character, none starting with ``.`` (the store's own temporary and digest files do);
- no symbolic link is followed: every existing component is checked with ``lstat``, files are opened with
  ``O_NOFOLLOW``, and the resolved path must still lie inside the job's folder.

An upload is written to a private temporary file in the job's folder and renamed into place once whole, with
its SHA-256 kept beside it (``<job>/.sha256/<name>/<path>``), so a listing does not read every byte again and
a half-written file is never listed.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tinkergym.scheduler.leases import CHECKPOINT_NAME

#: A job id as :func:`tinkergym.scheduler.repository.new_job_id` makes them.
JOB_ID = re.compile(r"^job_[0-9a-f]{1,36}$")
MAX_PATH_CHARS = 1024
MAX_COMPONENT_CHARS = 255
_CHUNK = 1 << 20
_DIGESTS = ".sha256"
_TMP = ".tmp"


class ArtifactPathError(ValueError):
    """A job id, checkpoint name or file path that could leave the job's folder, or is not allowed (HTTP 400)."""


class ArtifactTooLarge(Exception):
    """An upload past the store's size limit (HTTP 413)."""


@dataclass(frozen=True)
class FileInfo:
    """One stored file: its path inside the checkpoint folder, size in bytes and SHA-256 (hex)."""

    path: str
    size: int
    sha256: str

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "size": self.size, "sha256": self.sha256}


def check_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not JOB_ID.match(job_id):
        raise ArtifactPathError(f"job id {str(job_id)[:80]!r} is not one the scheduler made")
    return job_id


def check_name(name: str) -> str:
    """A checkpoint name: one folder name of letters, digits, '.', '_' and '-' (starting with a letter or digit)."""
    if not isinstance(name, str) or not CHECKPOINT_NAME.match(name) or name in (".", ".."):
        raise ArtifactPathError(f"checkpoint name {str(name)[:100]!r}: one folder name of letters, digits, '.', '_' and '-'")
    return name


def check_relpath(relpath: str) -> list[str]:
    """The components of a relative file path, or :class:`ArtifactPathError` for anything that could escape or hide."""
    if not isinstance(relpath, str) or not relpath or len(relpath) > MAX_PATH_CHARS:
        raise ArtifactPathError(f"a file path of 1 to {MAX_PATH_CHARS} characters is needed")
    if relpath.startswith("/") or "\\" in relpath or "\0" in relpath:
        raise ArtifactPathError(f"file path {relpath[:100]!r}: relative, '/'-separated, no backslash or NUL")
    parts = relpath.split("/")
    for part in parts:
        if part in ("", ".", "..") or part.startswith(".") or len(part) > MAX_COMPONENT_CHARS or not part.isprintable():
            raise ArtifactPathError(f"file path {relpath[:100]!r}: no empty, '.', '..' or hidden component, no control characters")
    return parts


class ArtifactStore:
    """What the scheduler needs of an artifact store (a directory now; an object store can implement the same)."""

    def open_upload(self, job_id: str, name: str, relpath: str, max_bytes: int) -> Upload:
        """A writer for one file; nothing is visible until its :meth:`Upload.commit`."""
        raise NotImplementedError

    def put_file(self, job_id: str, name: str, relpath: str, stream: BinaryIO | Iterable[bytes], max_bytes: int) -> FileInfo:
        """Store one file from a binary file object or an iterable of byte chunks; its :class:`FileInfo`."""
        upload = self.open_upload(job_id, name, relpath, max_bytes)
        try:
            chunks = iter(lambda: stream.read(_CHUNK), b"") if hasattr(stream, "read") else stream  # type: ignore[union-attr]
            for chunk in chunks:
                upload.write(chunk)
            return upload.commit()
        except BaseException:
            upload.abort()
            raise

    def open_file(self, job_id: str, name: str, relpath: str) -> tuple[BinaryIO, int]:
        """The stored file opened for reading, and its size; :class:`FileNotFoundError` when there is none."""
        raise NotImplementedError

    def list_files(self, job_id: str, name: str) -> list[FileInfo]:
        """Every file of a checkpoint (sorted by path); empty when there is none."""
        raise NotImplementedError

    def delete(self, job_id: str, name: str | None = None) -> None:
        """Remove a checkpoint's files (or, with no name, all of the job's)."""
        raise NotImplementedError


class Upload:
    """One file being written: :meth:`write` chunks, then :meth:`close` and :meth:`commit` (or :meth:`abort`)."""

    def __init__(self, tmp: Path, commit_to: Callable[[Path, int, str], FileInfo], max_bytes: int) -> None:
        self.tmp = tmp
        self._commit_to = commit_to
        self.max_bytes = max_bytes
        self.size = 0
        self.sha = hashlib.sha256()
        self._file = open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600), "wb")

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise ArtifactTooLarge(f"the file is larger than the artifact limit of {self.max_bytes:,} bytes")
        self.sha.update(chunk)
        self._file.write(chunk)

    def close(self) -> None:
        """Flush the bytes to disk (slow for a large file: do it before taking any lock)."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def commit(self) -> FileInfo:
        """Move the whole file into place (quick once :meth:`close` ran); its :class:`FileInfo`."""
        self.close()
        return self._commit_to(self.tmp, self.size, self.sha.hexdigest())

    def abort(self) -> None:
        if not self._file.closed:
            self._file.close()
        self.tmp.unlink(missing_ok=True)


class DirectoryStore(ArtifactStore):
    """Artifacts as files under ``root`` (``<data_dir>/jobs``): ``<root>/<job id>/<name>/<relative path>``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    # ----- paths ------------------------------------------------------------------------------------
    def _job_dir(self, job_id: str) -> Path:
        return self.root / check_job_id(job_id)

    def _inside(self, job_dir: Path, path: Path) -> Path:
        """``path`` if no existing component below the store's root is a symlink and it resolves inside ``job_dir``."""
        current = self.root
        for part in path.relative_to(self.root).parts:
            current = current / part
            try:
                if stat.S_ISLNK(os.lstat(current).st_mode):
                    raise ArtifactPathError(f"{current.relative_to(job_dir.parent)} is a symbolic link, which the store never follows")
            except FileNotFoundError:
                break
        resolved = os.path.realpath(path)
        if os.path.commonpath([resolved, str(job_dir)]) != str(job_dir):
            raise ArtifactPathError("the path resolves outside the job's folder")
        return path

    def path_of(self, job_id: str, name: str, relpath: str | None = None) -> Path:
        """Where a checkpoint (or one of its files) lives, checked to stay inside the job's folder."""
        job_dir = self._job_dir(job_id)
        path = job_dir / check_name(name)
        if relpath is not None:
            path = path.joinpath(*check_relpath(relpath))
        return self._inside(job_dir, path)

    def _digest_path(self, job_id: str, name: str, relpath: str) -> Path:
        return self._job_dir(job_id) / _DIGESTS / check_name(name) / Path(*check_relpath(relpath))

    def _mkdirs(self, job_dir: Path, folder: Path) -> None:
        """Create ``folder`` one component at a time, refusing a symlink anywhere on the way."""
        current = self.root
        for part in folder.relative_to(self.root).parts:
            current = current / part
            try:
                os.mkdir(current, 0o700)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(current).st_mode):
                    raise ArtifactPathError(f"{current.relative_to(self.root)} is not a folder (a file or a symbolic link)") from None
        self._inside(job_dir, folder)

    # ----- the interface ----------------------------------------------------------------------------
    def open_upload(self, job_id: str, name: str, relpath: str, max_bytes: int) -> Upload:
        job_dir = self._job_dir(job_id)
        final = self.path_of(job_id, name, relpath)
        digest_file = self._digest_path(job_id, name, relpath)
        tmp_dir = job_dir / _TMP
        self._mkdirs(job_dir, tmp_dir)
        tmp = tmp_dir / f"upload-{secrets.token_hex(8)}"

        def commit(tmp_file: Path, size: int, sha256: str) -> FileInfo:
            try:
                self._mkdirs(job_dir, final.parent)
                self._mkdirs(job_dir, digest_file.parent)
                self._inside(job_dir, final)
                if final.exists() and not final.is_file():
                    raise ArtifactPathError(f"{relpath[:100]!r} is a folder in checkpoint {name!r}")
                _write_atomic(digest_file, f"{sha256} {size}\n")
                os.replace(tmp_file, final)
            finally:
                tmp_file.unlink(missing_ok=True)
            return FileInfo(relpath, size, sha256)

        return Upload(tmp, commit, max_bytes)

    def open_file(self, job_id: str, name: str, relpath: str) -> tuple[BinaryIO, int]:
        path = self.path_of(job_id, name, relpath)
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))  # FileNotFoundError / OSError(ELOOP) on a link
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise FileNotFoundError(relpath)
        return os.fdopen(fd, "rb"), info.st_size

    def list_files(self, job_id: str, name: str) -> list[FileInfo]:
        folder = self.path_of(job_id, name)
        if not os.path.isdir(folder) or os.path.islink(folder):
            return []
        found = []
        for relpath in _walk(folder):
            size = os.lstat(folder / relpath).st_size
            found.append(FileInfo(relpath, size, self._sha256(job_id, name, relpath, size)))
        return sorted(found, key=lambda f: f.path)

    def delete(self, job_id: str, name: str | None = None) -> None:
        job_dir = self._job_dir(job_id)
        targets = [job_dir] if name is None else [self.path_of(job_id, name), job_dir / _DIGESTS / check_name(name)]
        for target in targets:
            if os.path.islink(target):
                os.unlink(target)
            else:
                shutil.rmtree(target, ignore_errors=True)

    def _sha256(self, job_id: str, name: str, relpath: str, size: int) -> str:
        """The kept digest when it matches the file's size; otherwise the file is read again."""
        try:
            kept, kept_size = self._digest_path(job_id, name, relpath).read_text(encoding="ascii").split()
            if int(kept_size) == size and len(kept) == 64:
                return kept
        except (OSError, ValueError):
            pass
        handle, _ = self.open_file(job_id, name, relpath)
        sha = hashlib.sha256()
        with handle:
            for chunk in iter(lambda: handle.read(_CHUNK), b""):
                sha.update(chunk)
        return sha.hexdigest()


def _walk(folder: Path) -> Iterator[str]:
    """Relative paths of the regular files under ``folder`` (symlinks and hidden names skipped, never followed)."""
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and not os.path.islink(os.path.join(dirpath, d))]
        for filename in filenames:
            path = os.path.join(dirpath, filename)
            if filename.startswith(".") or not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            yield os.path.relpath(path, folder).replace(os.sep, "/")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(text, encoding="ascii")
    os.replace(tmp, path)
