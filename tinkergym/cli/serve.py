"""``tinkergym serve-backend``: the training server."""

from __future__ import annotations

import click


@click.command("serve-backend")
def serve_backend() -> None:
    """Serve the Backend protocol over HTTP for remote training (not available yet)."""
    raise click.UsageError("serve-backend is not available in this version.")
