"""URLs a user gives (a training server's, a scheduler's): checked before anything connects."""

from __future__ import annotations

import os
import urllib.parse

from tinkergym.errors import ConfigError

#: The environment variable the CLI and the scheduler client read when no --scheduler URL is given.
SCHEDULER_ENV = "TINKERGYM_SCHEDULER"


def check_backend_url(url: str) -> str:
    """``url`` without a trailing slash, or a :class:`ConfigError` unless it is an ``http(s)://host[:port][/path]`` URL."""
    if not is_http_url(url):
        raise ConfigError(f"backend-url {url!r} is not a training server URL; give one such as http://127.0.0.1:8765")
    return url.rstrip("/")


def is_http_url(url: str) -> bool:
    """Whether ``url`` is ``http(s)://host[:port][/path]`` (no query, no fragment, a valid port)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port != -1 and not parts.query and not parts.fragment


def check_scheduler_url(url: str | None) -> str:
    """``url`` (or ``$TINKERGYM_SCHEDULER``) without a trailing slash; :class:`ConfigError` unless it is ``http(s)://host[:port][/path]``."""
    url = url or os.environ.get(SCHEDULER_ENV, "")
    if not url:
        raise ConfigError(f"no scheduler URL: pass --scheduler URL or set {SCHEDULER_ENV} (e.g. http://127.0.0.1:8780)")
    if not is_http_url(url):
        raise ConfigError(f"scheduler URL {url!r} is not an http(s)://host[:port] URL; give one such as http://127.0.0.1:8780")
    return url.rstrip("/")
