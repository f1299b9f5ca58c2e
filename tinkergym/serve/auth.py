"""Bearer-token authentication shared by tinkergym's HTTP servers (the training and the inference server).

A server reads its token from a file (``--token-file``; never from the command line, where ``ps`` shows it)
and keeps only its SHA-256 digest. A request passes when the SHA-256 of its ``Authorization: Bearer ...``
token equals that digest, compared in constant time (:func:`hmac.compare_digest`). Every route of an app
built with :func:`require_token` needs the token, except those listed as public (a health check).

A server a scheduler's worker starts for a lease is also bound to the lease's end (:class:`LeaseFile`): the worker
writes the lease's deadline into a file beside the token and moves it on with every heartbeat the scheduler
accepts; past the deadline the server refuses every call (401, ``lease_ended``), even when its worker is frozen
(SIGSTOP, swapped out, cut off) and can neither renew the lease nor stop the server. By then the scheduler may
have given the job to another worker; the job's client reconnects through the scheduler to the new server.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import stat
import time
from pathlib import Path

from tinkergym.errors import ConfigError

#: Shortest token accepted: 32 characters (e.g. ``python -c "import secrets; print(secrets.token_urlsafe(32))"``).
MIN_TOKEN_LENGTH = 32


def token_digest(token: str) -> bytes:
    """The SHA-256 digest of a token, the only form a server keeps."""
    return hashlib.sha256(token.encode("utf-8")).digest()


def read_token_file(path: str | os.PathLike[str]) -> str:
    """The token in ``path`` (first line, stripped); a missing, empty, short or world-readable file is a :class:`ConfigError`."""
    file = Path(path)
    try:
        mode = file.stat().st_mode
        text = file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--token-file {file}: cannot read it ({getattr(exc, 'strerror', None) or exc}).") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"--token-file {file} can be read by other users: chmod 600 {file}")
    token = text.strip().splitlines()[0].strip() if text.strip() else ""
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(
            f"--token-file {file}: the token must be at least {MIN_TOKEN_LENGTH} characters; make one with: "
            f"python -c \"import secrets; print(secrets.token_urlsafe(32))\" > {file} && chmod 600 {file}"
        )
    return token


def bearer_token(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def bearer_matches(authorization: str | None, digest: bytes) -> bool:
    """Whether an ``Authorization`` header carries the token whose digest is ``digest`` (constant time)."""
    token = bearer_token(authorization)
    return token is not None and hmac.compare_digest(token_digest(token), digest)


class LeaseFile:
    """The deadline of the lease a server serves under, in the file its worker renews (:func:`write_lease_file`).

    The file holds JSON ``{"until": <time.monotonic() seconds>, "epoch": N}``: the monotonic clock is the
    machine's, shared by the worker and its server and immune to changes of the wall clock. :meth:`ended` reads the
    file again only when it changed (one ``stat`` per call otherwise); a file that is missing or cannot be read
    ends the lease (fail closed).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._stamp: tuple[int, int, int] | None = None
        self._until = -math.inf

    def until(self) -> float:
        """The deadline (``time.monotonic()`` seconds); ``-inf`` when the file is missing or unreadable."""
        try:
            info = self.path.stat()
            stamp = (info.st_ino, info.st_mtime_ns, info.st_size)
            if stamp != self._stamp:
                until = float(json.loads(self.path.read_text(encoding="utf-8"))["until"])
                self._until, self._stamp = (until if math.isfinite(until) else -math.inf), stamp
        except (OSError, ValueError, KeyError, TypeError):
            self._until, self._stamp = -math.inf, None
        return self._until

    def ended(self) -> bool:
        return time.monotonic() >= self.until()


def write_lease_file(path: str | os.PathLike[str], until: float, epoch: int) -> None:
    """Write a lease's deadline (``time.monotonic()`` seconds) for its server's :class:`LeaseFile`, atomically, mode 0600."""
    from tinkergym.plumbing.folders import write_private_file

    write_private_file(path, json.dumps({"until": until, "epoch": epoch}))


def require_token(app, digest: bytes, public: frozenset[str] = frozenset({"/health"}), lease: LeaseFile | None = None) -> None:
    """Make every route of a FastAPI/Starlette ``app`` need the bearer token, except the ``public`` paths; with a
    ``lease``, refuse every call once the lease has ended, the right token's too.

    It is a middleware, so routes added later are covered too; a 401 carries ``WWW-Authenticate: Bearer``
    and an OpenAI-shaped error body.
    """
    from starlette.responses import JSONResponse

    @app.middleware("http")
    async def _authenticate(request, call_next):
        if request.url.path in public:
            return await call_next(request)
        if bearer_matches(request.headers.get("authorization"), digest):
            if lease is None or not lease.ended():
                return await call_next(request)
            message = ("this server's lease has ended (its worker stopped renewing it), so it takes no more calls: the scheduler "
                       "gives the job to another worker; connect to the job's new server through the scheduler")
            body = {"error": {"type": "lease_ended", "message": message, "code": 401}}
        else:
            body = {"error": {"type": "unauthorized", "message": "missing or wrong bearer token (Authorization: Bearer <token>)", "code": 401}}
        return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
