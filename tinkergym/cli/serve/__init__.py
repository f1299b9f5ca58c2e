"""``tinkergym serve``: the servers a machine runs for others: backend (training), shared (many LoRA adapters on one
base), model (inference), tinker (the Tinker API); each a module of this folder, beside what they share (server.py)."""

from __future__ import annotations

import click

from tinkergym.cli.serve.backend import serve_backend
from tinkergym.cli.serve.model import serve_model
from tinkergym.cli.serve.server import start_metrics
from tinkergym.cli.serve.shared import serve_shared
from tinkergym.cli.serve.tinker import serve_tinker


@click.group("serve")
def serve_group() -> None:
    """Run a server: training (backend), many LoRA adapters on one base (shared), inference (model), the Tinker API (tinker).

    A worker of the scheduler starts these itself; run one by hand to serve this machine to a remote trainer or client.

    \b
    Examples:
      tinkergym serve backend --model tiny --token-file token.txt --run-dir runs/server
      tinkergym serve shared --model tiny --token-file token.txt --run-dir runs/shared
      tinkergym serve model --run runs/bandit --api-key-file key.txt
      tinkergym serve tinker --model tiny --run-dir tinker-runs --data-dir tinker-data
    """


for _command in (serve_backend, serve_shared, serve_model, serve_tinker):
    serve_group.add_command(_command)

# start_metrics: `tinkergym train --metrics-port` serves its metrics as a server does.
__all__ = ["serve_group", "start_metrics"]
