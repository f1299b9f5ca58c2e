"""``tinkergym serve-model``: the OpenAI-compatible inference server."""

from __future__ import annotations

import click


@click.command("serve-model")
def serve_model() -> None:
    """Serve models through an OpenAI-compatible API (not available yet)."""
    raise click.UsageError("serve-model is not available in this version.")
