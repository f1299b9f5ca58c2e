"""How a job's run on a worker ends early: the exceptions a :class:`~tinkergym.scheduler.worker.agent.JobRunner` and
the places it runs on (its own server, or a seat of a shared server) raise. Standard library only."""

from __future__ import annotations


class LeaseLost(Exception):
    """The lease is gone (409 from the scheduler, or not renewed for its TTL): stop at once, report nothing."""


class Cancelled(Exception):
    """The job is cancelling: stop the server and report ``cancelled``."""


class Shutdown(Exception):
    """The worker is stopping: stop the server, report nothing (the lease expires and the job is queued again)."""


class WorkerFault(Exception):
    """This machine cannot run the job (a package, the model, a device, its disk): give the job back, do not fail it."""


class JobFault(Exception):
    """The job's own fault (its config, a server that refused it): fail the job with this one-line message."""
