"""``tinkergym serve``: the servers a machine runs for others (training, shared training, inference, the Tinker API)."""

from tinkergym.cli.serve.server import start_metrics  # train --metrics-port

__all__ = ["start_metrics"]
