"""What a route depends on: the request's authenticated principal and the scope its key must hold.

Routes import :func:`require` from here, and the app (which adds the auth middleware that sets the principal, and the
handler that answers :class:`Forbidden` with 403) imports the routes: no module imports the other back.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import Request

from tinkergym.scheduler.auth import Principal


class Forbidden(Exception):
    """The key is valid but may not do this (HTTP 403); ``kind`` is the error's type on the wire: ``scope`` (the key
    lacks the route's scope), ``not_a_worker`` (a tenant's key on a worker's route) or ``forbidden``."""

    def __init__(self, message: str, kind: str = "forbidden") -> None:
        super().__init__(message)
        self.kind = kind


def principal(request: Request) -> Principal:
    """The authenticated principal of a request (set by the auth middleware)."""
    return request.state.principal


def require(scope: str) -> Callable[[Request], Awaitable[Principal]]:
    """A dependency: the request's principal if its key has ``scope`` (``admin`` has every scope), else 403."""

    async def dependency(request: Request) -> Principal:  # async: FastAPI would run a plain def in a thread
        who = principal(request)
        if scope == "worker" and who.bounds is None:  # a tenant's key, whatever its scopes, never acts as a worker
            raise Forbidden(f"this is a key of tenant {who.tenant_id} ({', '.join(sorted(who.scopes))}), not a worker credential: a "
                            "worker needs one, which the operator makes on the scheduler's machine with: tinkergym scheduler "
                            "workers create NAME --devices N > worker-key.txt", "not_a_worker")
        if not who.allows(scope):
            raise Forbidden(f"this key lacks the {scope!r} scope (it has: {', '.join(sorted(who.scopes))})", "scope")
        return who

    dependency.__name__ = f"require_{scope}"
    return dependency
