"""Clients that share a cache keep an endpoint's tokenizer files once per content, and none ever reads a half-written folder.

Two writers of the same files race: the first is held between writing its private copy and moving it into place while
the second writes and moves its own. Both must get the one folder, whole, and leave nothing behind; a reader meanwhile
sees the folder absent or complete.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tinkergym.backends import tokenizer_files
from tinkergym.backends.tokenizer_files import cache_tokenizer_files

FILES = {"tokenizer.json": '{"model": "' + "x" * 50_000 + '"}', "tokenizer_config.json": '{"eos_token": "</s>"}', "special_tokens_map.json": "{}"}


def test_two_writers_racing_get_one_whole_folder_and_leave_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rename = tokenizer_files.os.rename
    first_written, second_done = threading.Event(), threading.Event()

    def held_rename(src, dst):  # the first writer waits here, its copy written, until the second has finished
        if threading.current_thread().name == "first":
            first_written.set()
            assert second_done.wait(30)
        rename(src, dst)

    monkeypatch.setattr(tokenizer_files.os, "rename", held_rename)
    got: dict[str, str] = {}

    def write(name: str) -> None:
        got[name] = cache_tokenizer_files({"files": FILES}, tmp_path, "a test endpoint")

    first = threading.Thread(target=write, args=("first",), name="first")
    first.start()
    assert first_written.wait(30)
    readable = [p.name for p in tmp_path.iterdir() if not p.name.endswith(".tmp")]  # a reader now: no folder yet, only a private copy
    write("second")
    second_done.set()
    first.join(30)
    assert not first.is_alive()

    assert readable == []
    assert got["first"] == got["second"]
    folder = Path(got["first"])
    assert {p.name: p.read_text(encoding="utf-8") for p in folder.iterdir()} == FILES
    assert [p.name for p in tmp_path.iterdir()] == [folder.name]  # the loser's private copy is gone


def test_other_files_get_another_folder_and_the_same_files_the_same_one(tmp_path: Path) -> None:
    one = cache_tokenizer_files({"files": FILES}, tmp_path, "a test endpoint")
    again = cache_tokenizer_files({"files": dict(reversed(list(FILES.items())))}, tmp_path, "a test endpoint")
    other = cache_tokenizer_files({"files": {**FILES, "tokenizer_config.json": "{}"}}, tmp_path, "a test endpoint")
    assert one == again != other
    assert Path(other, "tokenizer_config.json").read_text() == "{}" and Path(one, "tokenizer_config.json").read_text() == FILES["tokenizer_config.json"]
