"""The job store's refusals, which the app answers with 409 and 404 (a module of their own: the store and the quota
checks it calls both raise them)."""

from __future__ import annotations


class Conflict(Exception):
    """A compare-and-set lost: the job is not in a state (or lease epoch) the write expects (HTTP 409)."""


class NotFound(Exception):
    """No such job for this tenant (HTTP 404: another tenant's job is not found either)."""
