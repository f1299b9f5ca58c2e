"""The job state machine, written down once.

::

    queued --grant--> leased --worker starts the server--> starting --server ready--> running
    running --> succeeded | failed                       (the job's own end)
    queued --> cancelled                                 (cancel before any lease)
    leased | starting | running --cancel--> cancelling --worker stopped it--> cancelled
    leased | starting | running --lease lost--> queued   (attempt + 1; failed once attempts reach the maximum)
    cancelling --lease lost--> cancelled                 (nobody is left to stop it)

Every transition is a compare-and-set in the database (:meth:`tinkergym.scheduler.repository.JobStore.transition`):
``UPDATE jobs SET state = :to WHERE id = :id AND state IN (:allowed sources) [AND lease_epoch = :epoch]``;
zero rows updated means another writer won and the caller is told so (409), never silently overwritten.
"""

from __future__ import annotations

QUEUED = "queued"
LEASED = "leased"
STARTING = "starting"
RUNNING = "running"
CANCELLING = "cancelling"
SUCCEEDED = "succeeded"
FAILED = "failed"
CANCELLED = "cancelled"

STATES = (QUEUED, LEASED, STARTING, RUNNING, CANCELLING, SUCCEEDED, FAILED, CANCELLED)
#: States a job never leaves.
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
#: States in which a job holds a lease (and its devices).
HOLDING = frozenset({LEASED, STARTING, RUNNING, CANCELLING})

#: to-state -> the states it may be entered from.
TRANSITIONS: dict[str, frozenset[str]] = {
    QUEUED: frozenset({LEASED, STARTING, RUNNING}),  # a lost lease requeues (attempt + 1)
    LEASED: frozenset({QUEUED}),
    STARTING: frozenset({LEASED}),
    RUNNING: frozenset({STARTING}),
    CANCELLING: frozenset({LEASED, STARTING, RUNNING}),
    SUCCEEDED: frozenset({RUNNING}),
    FAILED: frozenset({QUEUED, LEASED, STARTING, RUNNING}),  # queued: attempts exhausted, or a config refused
    CANCELLED: frozenset({QUEUED, CANCELLING}),
}

#: Job kinds: what the worker starts for them.
KINDS = ("train", "sft", "eval", "inference")


def sources(to_state: str) -> frozenset[str]:
    """The states from which ``to_state`` may be entered (a :class:`ValueError` for an unknown state)."""
    try:
        return TRANSITIONS[to_state]
    except KeyError:
        raise ValueError(f"unknown job state {to_state!r}; the states are {', '.join(STATES)}") from None


def can_move(from_state: str, to_state: str) -> bool:
    """Whether the state machine allows ``from_state -> to_state``."""
    return from_state in sources(to_state)
