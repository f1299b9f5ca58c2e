"""``save_checked`` over a real HTTP response: a file is kept only when its size and SHA-256 are the listed ones."""

from __future__ import annotations

import hashlib
import http.client
import http.server
import threading
from pathlib import Path
from collections.abc import Iterator

import pytest

from tinkergym.plumbing.downloads import DownloadMismatchError, save_checked

BODY = b"weights " * 50_000


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def port() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _get(port: int, dest: Path, size: int, sha256: str) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", "/file")
        save_checked(connection.getresponse(), dest, size, sha256)
    finally:
        connection.close()


def test_a_matching_file_is_kept_and_no_part_file_is_left(port: int, tmp_path: Path) -> None:
    dest = tmp_path / "adapter_model.safetensors"
    _get(port, dest, len(BODY), hashlib.sha256(BODY).hexdigest())
    assert dest.read_bytes() == BODY
    assert [p.name for p in tmp_path.iterdir()] == [dest.name]


@pytest.mark.parametrize(
    ("size", "sha256"),
    [(len(BODY) + 1, hashlib.sha256(BODY).hexdigest()), (len(BODY), hashlib.sha256(b"other").hexdigest())],
    ids=["size", "sha256"],
)
def test_a_mismatch_keeps_nothing_and_says_what_came(port: int, tmp_path: Path, size: int, sha256: str) -> None:
    dest = tmp_path / "state.json"
    dest.write_bytes(b"the previous file")
    with pytest.raises(DownloadMismatchError) as caught:
        _get(port, dest, size, sha256)
    assert caught.value.written == len(BODY) and caught.value.sha256 == hashlib.sha256(BODY).hexdigest()
    assert isinstance(caught.value, ValueError) and "download it again" in str(caught.value)
    assert dest.read_bytes() == b"the previous file"
    assert [p.name for p in tmp_path.iterdir()] == [dest.name]
