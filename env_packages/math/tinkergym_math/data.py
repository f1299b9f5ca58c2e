"""Loading math problems: the shipped dataset, JSONL and Parquet files, or an iterable of dicts.

Every source yields :class:`Problem` records with a question and an answer. Records need
``"question"`` (non-empty text) and ``"answer"`` (text or a number); ``"id"`` and ``"topic"`` are
optional. An answer in GSM8K form (``"...reasoning... #### 42"``) keeps only what follows ``####``.
A bad record is a :class:`~tinkergym.errors.ConfigError` that names the file and line (or row, or
record number) and says what is wrong: invalid JSON, JSON nested too deeply to read, a file that
is not UTF-8 text, a field of the wrong type.
"""

from __future__ import annotations

import json
import os
import reprlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Mapping

from tinkergym.errors import ConfigError
from tinkergym.spaces import is_printable_text

#: Where the shipped ``train.jsonl`` and ``test.jsonl`` live.
DATA_DIR = Path(__file__).resolve().parent / "data"
SPLITS = ("train", "test")
#: Longest question accepted, in characters (observations must fit the env's text space).
MAX_QUESTION_LENGTH = 12_000
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_PARQUET_SUFFIXES = (".parquet", ".pq")
_SHOWN = reprlib.Repr()  # bounded in depth and length, so a hostile record cannot blow up an error message
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 3, 50, 50


@dataclass(frozen=True)
class Problem:
    """One problem: its id, topic (may be empty), question text and expected answer text."""

    id: str
    topic: str
    question: str
    answer: str


def printable(text: str) -> str:
    """``text`` with every non-printable character (other than newline and tab) turned into a space."""
    if is_printable_text(text):
        return text
    return "".join(c if c in "\n\t" or c.isprintable() else " " for c in text)


def make_problem(record: Any, where: str, default_id: str) -> Problem:
    """Validate one record (a mapping) into a :class:`Problem`; ``where`` names it in errors."""
    if not isinstance(record, Mapping):
        raise ConfigError(f"{where}: expected an object with 'question' and 'answer', got {type(record).__name__}.")
    question, answer = record.get("question"), record.get("answer")
    if not isinstance(question, str) or not question.strip():
        raise ConfigError(f"{where}: 'question' must be non-empty text; got {_shown(question)}. Each record needs 'question' and 'answer'.")
    if len(question) > MAX_QUESTION_LENGTH:
        raise ConfigError(f"{where}: the question is {len(question):,} characters long; the limit is {MAX_QUESTION_LENGTH:,}.")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ConfigError(f"{where}: 'answer' must be text or a number; got {_shown(answer)}.")
    answer_text = answer if isinstance(answer, str) else repr(answer)
    if "####" in answer_text:
        answer_text = answer_text.rsplit("####", 1)[1]
    answer_text = answer_text.strip()
    if not answer_text:
        raise ConfigError(f"{where}: 'answer' is empty.")
    problem_id = record.get("id", default_id)
    topic = record.get("topic", "")
    for name, value in (("id", problem_id), ("topic", topic)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int, float))):
            raise ConfigError(f"{where}: {name!r} must be text or a number if given; got {_shown(value)}.")
    return Problem(
        id=str(problem_id),
        topic=str(topic) if topic is not None else "",
        question=printable(question.strip()),
        answer=printable(answer_text)[:1000],
    )


def _shown(value: Any) -> str:
    text = _SHOWN.repr(value)
    return text if len(text) <= 60 else text[:60] + "..."


def load_jsonl(path: Path) -> list[Problem]:
    """Problems from a JSONL file (one JSON object per line, UTF-8; blank lines skipped)."""
    problems = []
    try:
        with open(path, "rb") as handle:
            for number, raw in enumerate(handle, 1):
                where = f"{path}, line {number}"
                record = _json_line(raw, where, first=number == 1)
                if record is not _BLANK:
                    problems.append(make_problem(record, where, f"{path.stem}-{number}"))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the file ({exc.strerror or exc}).") from exc
    return problems


_BLANK = object()


def _json_line(raw: bytes, where: str, first: bool) -> Any:
    """The JSON value on one line of a JSONL file (``_BLANK`` for a blank line); every problem is a ConfigError."""
    try:
        line = raw.decode("utf-8-sig" if first else "utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start + 1} of the line); JSONL files must be UTF-8.") from exc
    if not line.strip():
        return _BLANK
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}).") from exc
    except RecursionError as exc:
        raise ConfigError(f"{where}: the JSON nests arrays or objects too deeply to read; a record is one flat object with 'question' and 'answer'.") from exc
    except ValueError as exc:  # e.g. an integer past Python's digit limit
        raise ConfigError(f"{where}: cannot read the JSON ({exc}).") from exc


def load_parquet(path: Path) -> list[Problem]:
    """Problems from a Parquet file with ``question`` and ``answer`` columns (needs pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:
        raise ConfigError(f"{path}: reading Parquet needs pyarrow; run `pip install pyarrow`, or convert the file to JSONL.") from exc
    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises its own error types for corrupt files
        raise ConfigError(f"{path}: cannot read it as Parquet ({type(exc).__name__}: {exc}).") from exc
    return [make_problem(row, f"{path}, row {i}", f"{path.stem}-{i}") for i, row in enumerate(rows)]


def load_file(path: str | os.PathLike[str]) -> list[Problem]:
    """Problems from one ``.jsonl``/``.ndjson`` or ``.parquet`` file."""
    path = Path(path)
    try:
        is_file = path.is_file()
    except (OSError, ValueError) as exc:  # a name too long for the file system, a NUL byte
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)[:200]
        raise ConfigError(f"data file {str(path)[:200]!r}: cannot be used as a path ({reason}).") from exc
    if not is_file:
        raise ConfigError(f"data file {str(path)[:200]!r} does not exist (or is not a file).")
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        return load_jsonl(path)
    if suffix in _PARQUET_SUFFIXES:
        return load_parquet(path)
    raise ConfigError(f"data file {str(path)!r}: unknown format {suffix or '(no suffix)'}; use .jsonl or .parquet.")


@lru_cache(maxsize=len(SPLITS))
def load_split(split: str) -> tuple[Problem, ...]:
    """The shipped ``train`` or ``test`` split (cached)."""
    if split not in SPLITS:
        raise ConfigError(f"split={split!r}: use one of {list(SPLITS)}, or pass data_files=... for your own data.")
    return tuple(load_jsonl(DATA_DIR / f"{split}.jsonl"))


def _is_path(value: Any) -> bool:
    return isinstance(value, (str, os.PathLike))


def load_problems(data_files: Any = None, split: str = "train") -> tuple[Problem, ...]:
    """Resolve the env's data kwargs into problems.

    Args:
        data_files: ``None`` (the shipped ``split``), a path, a list of paths, or an iterable of
            ``{"question", "answer"}`` dicts.
        split: ``"train"`` or ``"test"``; used only when ``data_files`` is ``None``.

    Raises:
        ConfigError: a missing or unreadable file, a bad record (named by file and line), no problems.
    """
    if data_files is None:
        return load_split(split)
    if _is_path(data_files):
        problems = load_file(data_files)
        source = str(data_files)
    elif isinstance(data_files, (bytes, Mapping)) or not isinstance(data_files, Iterable):
        raise ConfigError(
            f"data_files={_shown(data_files)}: pass a path, a list of paths, or an iterable of {{'question', 'answer'}} dicts."
        )
    else:
        items = list(data_files)
        if items and all(_is_path(item) for item in items):
            problems = [p for item in items for p in load_file(item)]
            source = ", ".join(map(str, items))
        else:
            problems = [make_problem(item, f"data_files record {i}", f"record-{i}") for i, item in enumerate(items)]
            source = "data_files"
    if not problems:
        raise ConfigError(f"{source}: no problems found; each record needs 'question' and 'answer'.")
    return tuple(problems)
