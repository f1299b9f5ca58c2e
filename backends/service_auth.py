"""Bearer-token authentication shared by tinkergym's HTTP servers (the training and the inference server).

A server reads its token from a file (``--token-file``; never from the command line, where ``ps`` shows it)
and keeps only its SHA-256 digest. A request passes when the SHA-256 of its ``Authorization: Bearer ...``
token equals that digest, compared in constant time (:func:`hmac.compare_digest`). Every route of an app
built with :func:`require_token` needs the token, except those listed as public (a health check).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import stat
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


def bearer_matches(authorization: str | None, digest: bytes) -> bool:
    """Whether an ``Authorization`` header carries the token whose digest is ``digest`` (constant time)."""
    if not authorization:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    return hmac.compare_digest(token_digest(token.strip()), digest)


def require_token(app, digest: bytes, public: frozenset[str] = frozenset({"/health"})) -> None:
    """Make every route of a FastAPI/Starlette ``app`` need the bearer token, except the ``public`` paths.

    It is a middleware, so routes added later are covered too; a 401 carries ``WWW-Authenticate: Bearer``
    and an OpenAI-shaped error body.
    """
    from starlette.responses import JSONResponse

    @app.middleware("http")
    async def _authenticate(request, call_next):
        if request.url.path in public or bearer_matches(request.headers.get("authorization"), digest):
            return await call_next(request)
        body = {"error": {"type": "unauthorized", "message": "missing or wrong bearer token (Authorization: Bearer <token>)", "code": 401}}
        return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
