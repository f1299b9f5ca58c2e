"""Whose turn it is on a backend that samples and trains on one device: sampling goes first.

With ``async_steps`` K > 0 the next steps' rollouts sample from snapshots on background threads while the trainer
trains (:mod:`tinkergym.trainers.async_rollouts`); the backend runs one call at a time, and the order of the calls
decides what overlaps. A sample call unblocks env work that then runs beside the device (a tool, an API, a judge: the
env's time overlaps the next training call), while a training call unblocks nothing until the step ends. So a
sample call that waits goes before a training call that waits, and a long training call (``forward_backward``) lets
waiting sample calls in between its micro-batches (:meth:`TurnLock.let_samplers_in`): a rollout whose env answered
mid-step waits for one micro-batch, not for the whole update. Training never starves: only the rollouts handed over
(at most K steps' worth) sample, and each of them ends.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class TurnLock:
    """A reentrant lock whose waiting sample calls go before its waiting training calls.

    ``hold(sampling=True)`` for a sample call, ``hold()`` for any other; the thread that holds it may take it again
    (as an ``RLock``). :attr:`waiting_samplers` says how many sample calls wait now.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self.waiting_samplers = 0

    @contextlib.contextmanager
    def hold(self, sampling: bool = False) -> Iterator[None]:
        """Hold the lock for one call: a sample call (``sampling``) once no one holds it, any other call once no one holds
        it and no sample call waits."""
        self._acquire(sampling)
        try:
            yield
        finally:
            self._release()

    def let_samplers_in(self) -> bool:
        """Called by the holder between two parts of a long call: if sample calls wait (and the holder holds the lock once,
        not from inside another call), hand the lock to them and take it back once they are done. Whether it did."""
        me = threading.get_ident()
        with self._cond:
            if self._owner != me or self._depth != 1 or not self.waiting_samplers:
                return False
        self._release()
        self._acquire(False)
        return True

    def _acquire(self, sampling: bool) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return
            if sampling:
                self.waiting_samplers += 1
            try:
                while self._owner is not None or (not sampling and self.waiting_samplers):
                    self._cond.wait()
            finally:
                if sampling:
                    self.waiting_samplers -= 1
            self._owner, self._depth = me, 1

    def _release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("a TurnLock is released by the thread that holds it")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()
