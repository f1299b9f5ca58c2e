"""The scheduler's web dashboard at ``/ui/``: static files shipped in this package, served without a key.

The page itself holds no privilege. It asks for an API key, keeps it in the browser tab's ``sessionStorage``, and
makes ordinary authenticated calls (``Authorization: Bearer``) to the job routes, so a tenant's key sees that
tenant's jobs and nothing else. Only the files are public: :func:`is_ui_path` names the paths the auth middleware
lets through, and :class:`DashboardFiles` answers every one of them itself (a file of ``static/``, a redirect from
``/ui`` and from the scheduler's root ``/`` to ``/ui/``, or a 404), so no route of the API is reachable through them.

The files are plain ES modules (``static/*.js``) and uPlot (MIT, ``static/vendor/``, its licence beside it) for the
charts: no build step, no CDN. They are read once, when the app is built, and sent with a content security policy
that allows this origin's scripts, styles and API alone.
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any

PREFIX = "/ui"
#: The scheduler's own address: a browser sent there is led to the dashboard (which asks for a key), nothing more.
ROOT = "/"
#: The media types of the files served; a file with another suffix is not served.
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".LICENSE": "text/plain; charset=utf-8",
}
#: Scripts, styles and API calls from this origin only; no inline script, no framing, no form posts elsewhere.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
    "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cache-control": "no-cache",
}


def is_ui_path(path: str) -> bool:
    """Whether ``path`` is the dashboard's (``/ui``, under ``/ui/``, or the root ``/`` that leads to it): public, and answered
    by :class:`DashboardFiles` alone."""
    return path in (PREFIX, ROOT) or path.startswith(PREFIX + "/")


def load_files() -> dict[str, tuple[bytes, str, str]]:
    """``{path under /ui/: (body, media type, ETag)}`` for every file of ``static/`` with a known suffix."""
    found: dict[str, tuple[bytes, str, str]] = {}

    def walk(folder: Any, prefix: str) -> None:
        for entry in folder.iterdir():
            if entry.is_dir():
                walk(entry, f"{prefix}{entry.name}/")
                continue
            suffix = "." + entry.name.rsplit(".", 1)[-1] if "." in entry.name else ""
            if suffix in MEDIA_TYPES:
                body = entry.read_bytes()
                found[prefix + entry.name] = (body, MEDIA_TYPES[suffix], '"' + hashlib.sha256(body).hexdigest()[:32] + '"')

    walk(resources.files(__name__) / "static", "")
    return found


class DashboardFiles:
    """ASGI middleware: answers every :func:`is_ui_path` request from the shipped files; passes every other request on."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.files = load_files()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not is_ui_path(scope["path"]):
            return await self.app(scope, receive, send)
        if scope["method"] not in ("GET", "HEAD"):
            return await self._send(send, 405, b"method not allowed\n", "text/plain; charset=utf-8", {"allow": "GET, HEAD"})
        if scope["path"] in (PREFIX, ROOT):  # relative URLs in the page resolve against /ui/; the root is where people look first
            location = scope.get("root_path", "") + PREFIX + "/"
            return await self._send(send, 307, b"", "text/plain; charset=utf-8", {"location": location})
        name = scope["path"][len(PREFIX) + 1:] or "index.html"
        found = self.files.get(name)
        if found is None:
            return await self._send(send, 404, b"not found\n", "text/plain; charset=utf-8")
        body, media_type, etag = found
        if etag in dict(scope["headers"]).get(b"if-none-match", b"").decode("latin-1"):
            return await self._send(send, 304, b"", media_type, {"etag": etag})
        await self._send(send, 200, b"" if scope["method"] == "HEAD" else body, media_type, {"etag": etag}, length=len(body))

    @staticmethod
    async def _send(send: Any, status: int, body: bytes, media_type: str, extra: dict[str, str] | None = None,
                    length: int | None = None) -> None:
        headers = {**SECURITY_HEADERS, "content-type": media_type, **(extra or {})}
        if status != 304:
            headers["content-length"] = str(len(body) if length is None else length)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]})
        await send({"type": "http.response.body", "body": body})


def mount_ui(app: Any) -> None:
    """Serve the dashboard at ``/ui/`` in ``app``: add it innermost, before the app's other middleware."""
    app.add_middleware(DashboardFiles)
