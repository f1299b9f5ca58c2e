"""reasoning-gym's scorers under a wall-clock limit, in a child Python process.

Several datasets' ``score_answer`` evaluate the answer with sympy or Python's number parsing, and a hostile
answer (``10**10**10``, ``1e999999``, ``factorial(10**9)``) keeps them busy for minutes. Env calls run on
threads (the rollout loop's pool), where no signal can interrupt them, so scoring runs in one long-lived
child process per Python process: ``python -m tinkergym_reasoning_gym.scoring``, spoken to over its standard
input and output (pickled, length-prefixed messages: the child is ours, started from this interpreter). A
call that passes its limit kills the child, scores 0 and says so; the next call starts a new one.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO

_HEADER = struct.Struct("!Q")
#: Seconds a new child may take to import reasoning-gym and answer its first call, on top of the call's limit.
START_SECONDS = 120.0


def _write(stream: BinaryIO, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


class ScorerTimeout(Exception):
    """The child did not answer in time (it is killed)."""


class ScorerFailed(RuntimeError):
    """The scorer raised in the child (the message is its exception's type and message)."""


class ScoringProcess:
    """One child process that scores answers for every env of this process, one call at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._loaded: set[str] = set()
        self._buffer = b""

    def score(self, key: str, dataset_cls: type, config: Any, answer: str | None, entry: dict[str, Any], timeout: float) -> float:
        """The score of ``answer`` by ``dataset_cls(config=config).score_answer``, built once per ``key`` in the child.

        Raises:
            ScorerTimeout: no answer within ``timeout`` seconds (the child is killed).
            ScorerFailed: the scorer raised (its type and message).
            OSError, EOFError: the child died (it is restarted at the next call).
        """
        with self._lock:
            started = self._proc is None or self._proc.poll() is not None
            if started:
                self._start()
            assert self._proc is not None and self._proc.stdin is not None
            dataset = None if key in self._loaded else (dataset_cls, config)
            try:
                _write(self._proc.stdin, (key, dataset, answer, entry))
                status, value = self._read(time.monotonic() + timeout + (START_SECONDS if started else 0.0))
            except (OSError, EOFError, ScorerTimeout):
                self._stop()
                raise
            self._loaded.add(key)
            if status != "ok":
                raise ScorerFailed(value)
            return float(value)

    def _start(self) -> None:
        self._stop()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tinkergym_reasoning_gym.scoring"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, close_fds=True,
        )
        self._loaded.clear()
        self._buffer = b""

    def _read(self, deadline: float) -> tuple[str, Any]:
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while True:
            if len(self._buffer) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(self._buffer)
                if len(self._buffer) >= _HEADER.size + size:
                    data = self._buffer[_HEADER.size : _HEADER.size + size]
                    self._buffer = self._buffer[_HEADER.size + size :]
                    return pickle.loads(data)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise ScorerTimeout
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError("the scoring process exited")
            self._buffer += chunk

    def _stop(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    def close(self) -> None:
        """End the child process (it also ends by itself when this process closes its pipe)."""
        with self._lock:
            self._stop()


_shared: dict[str, ScoringProcess] = {}
_shared_lock = threading.Lock()


def shared_scorer() -> ScoringProcess:
    """The scoring process every env of this Python process uses (started at its first call)."""
    with _shared_lock:
        if "process" not in _shared:
            _shared["process"] = ScoringProcess()
        return _shared["process"]


def _serve(requests: BinaryIO, replies: BinaryIO) -> None:
    """The child's loop: build each dataset once, score, reply ``("ok", score)`` or ``("error", message)``."""
    import reasoning_gym  # noqa: F401 - registers every dataset, as in the parent

    datasets: dict[str, Any] = {}
    while True:
        header = requests.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return
        key, dataset, answer, entry = pickle.loads(requests.read(_HEADER.unpack(header)[0]))
        try:
            if dataset is not None:
                dataset_cls, config = dataset
                datasets[key] = dataset_cls(config=config)
            reply: tuple[str, Any] = ("ok", float(datasets[key].score_answer(answer, entry)))
        except Exception as exc:  # noqa: BLE001 - any scorer failure is reported to the env, which scores 0
            reply = ("error", f"{type(exc).__name__}: {exc}"[:500])
        _write(replies, reply)


if __name__ == "__main__":
    # Datasets print; only our replies may reach the pipe, so the protocol keeps stdout's descriptor and fd 1 becomes stderr.
    protocol_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _serve(sys.stdin.buffer, protocol_out)
