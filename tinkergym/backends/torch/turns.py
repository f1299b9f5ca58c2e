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
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


#: The longest a training call waits for sample calls to go first (a bound, never a hang: see :class:`TurnLock`).
SAMPLERS_FIRST_S = 10.0


class TurnLock:
    """A reentrant lock whose sample calls go before the training calls that wait.

    The exclusion is a C ``RLock`` (:attr:`rlock`), taken with ``with``, so a Ctrl-C that lands anywhere in a call
    leaves it as a plain ``RLock`` would. The order is a gate in front of it: a sample call counts itself from the
    moment it waits until it ends (:meth:`sampling`), and a training call first waits until no sample call is counted
    (:meth:`wait_for_samplers`, at most :data:`SAMPLERS_FIRST_S`: a bound, never a hang).
    """

    def __init__(self) -> None:
        self.rlock = threading.RLock()
        self._turns = threading.Condition(threading.Lock())
        #: How many calls deep the holder is (kept by :meth:`call`).
        self.depth = 0
        #: Sample calls waiting for the lock or holding it.
        self.waiting_samplers = 0

    def call(self, function: Callable[[], T], sampling: bool = False) -> T:
        """``function()`` holding the lock: a sample call (``sampling``) counted while it waits and runs, any other call
        after :meth:`wait_for_samplers`."""
        if not sampling:
            self.wait_for_samplers()
        with self.sampling() if sampling else contextlib.nullcontext(), self.rlock:
            self.depth += 1
            try:
                return function()
            finally:
                self.depth -= 1

    @contextlib.contextmanager
    def sampling(self) -> Iterator[None]:
        """Count a sample call while it waits and runs."""
        with self._turns:
            self.waiting_samplers += 1
        try:
            yield
        finally:
            with self._turns:
                self.waiting_samplers -= 1
                self._turns.notify_all()

    def wait_for_samplers(self) -> None:
        """Before a training call takes the lock: wait until no sample call waits or runs (at most :data:`SAMPLERS_FIRST_S`);
        a call made from inside another call (the lock held already) does not wait."""
        if not self.rlock._is_owned():  # type: ignore[attr-defined]  # the C RLock's, as threading.Condition uses it
            self._wait_out_samplers()

    def let_samplers_in(self) -> bool:
        """Called by the holder between two parts of a long call: if sample calls wait (and the holder holds the lock once,
        not from inside another call), hand the lock to them and take it back once they are done. Whether it did."""
        if not self.waiting_samplers or self.depth != 1 or not self.rlock._is_owned():  # type: ignore[attr-defined]
            return False
        self.rlock.release()
        try:
            self._wait_out_samplers()
        finally:
            self.rlock.acquire()
        return True

    def _wait_out_samplers(self) -> None:
        with self._turns:
            self._turns.wait_for(lambda: not self.waiting_samplers, timeout=SAMPLERS_FIRST_S)
