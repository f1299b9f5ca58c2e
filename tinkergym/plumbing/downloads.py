"""Files downloaded whole and checked: stream an HTTP response into a ``.part`` file, keep it only when its size and
SHA-256 match what the server listed.

Standard library only (no torch): the remote backend's export download and ``tinkergym jobs download`` share it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import BinaryIO

from tinkergym.errors import TinkergymError

CHUNK = 1 << 20


class DownloadMismatchError(TinkergymError, ValueError):
    """A downloaded file whose size or SHA-256 is not the listed one; nothing was kept, download it again."""

    def __init__(self, written: int, sha256: str, expected_size: int, expected_sha256: str) -> None:
        self.written, self.sha256 = written, sha256
        self.expected_size, self.expected_sha256 = expected_size, expected_sha256
        super().__init__(
            f"got {written} bytes with SHA-256 {sha256}, the listing says {expected_size} bytes with {expected_sha256}; download it again"
        )


def save_checked(response: BinaryIO, dest: Path, size: int, sha256: str) -> None:
    """Stream ``response`` (an ``http.client.HTTPResponse`` or any binary stream) into ``dest`` through ``dest.part``.

    The ``.part`` file replaces ``dest`` only when its size and SHA-256 are ``size`` and ``sha256``; otherwise
    :class:`DownloadMismatchError` is raised, ``dest`` is left as it was and the ``.part`` file is removed.
    """
    part = dest.with_name(dest.name + ".part")
    try:
        digest, written = hashlib.sha256(), 0
        with part.open("wb") as handle:
            while chunk := response.read(CHUNK):
                digest.update(chunk)
                handle.write(chunk)
                written += len(chunk)
        if written != size or digest.hexdigest() != sha256:
            raise DownloadMismatchError(written, digest.hexdigest(), size, sha256)
        os.replace(part, dest)
    finally:
        part.unlink(missing_ok=True)
