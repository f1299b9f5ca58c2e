"""Backends behind the Backend protocol, found by name as trainers are: the entry-point group ``tinkergym.backends``.

Engines compute (``torch/``: TorchBackend; ``vllm/``: vLLM sampling beside it); clients reach compute elsewhere
(``remote``: a training server; ``scheduled``: a scheduler's job). Each registered name points at a factory
``build(request: BackendRequest) -> Backend``; a package adds a backend by declaring one in its ``pyproject.toml``::

    [project.entry-points."tinkergym.backends"]
    mybackend = "my_package.backend:build"

and ``tinkergym train --backend mybackend`` trains through it. Without ``--backend`` a run's settings choose one of
the four built in (:func:`backend_name`). Nothing here imports torch.
"""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass, replace
from typing import Any
from collections.abc import Callable

from tinkergym.registry import plugins
from tinkergym.errors import ConfigError

#: The entry-point group of backend factories.
BACKEND_GROUP = "tinkergym.backends"
#: The backends of this distribution, chosen by a run's settings.
BUILT_IN = ("torch", "vllm", "remote", "scheduled")


@dataclass(frozen=True)
class BackendRequest:
    """What a backend factory gets: the run's config and what is never saved with it."""

    config: Any  # a tinkergym.config.TrainConfig
    backend_token: str | None = None  # a training server's token (backend "remote")
    api_key: str | None = None  # the scheduler's API key (backend "scheduled")
    name: str = ""  # the run's name (the scheduler job's name)


def backend_name(config: Any) -> str:
    """The backend a run trains through: its ``backend`` when set, else the one its settings imply."""
    if getattr(config, "backend", None):
        return config.backend
    if config.scheduler_url:
        return "scheduled"
    if config.backend_url:
        return "remote"
    return "vllm" if config.sampler == "vllm" else "torch"


def available_backends() -> dict[str, md.EntryPoint]:
    """Installed backend plugins by name (metadata only)."""
    return plugins.available(BACKEND_GROUP)


def load_backend_factory(name: str) -> Callable[[BackendRequest], Any]:
    """The factory registered as ``name``; an unknown name lists the installed ones."""
    return plugins.load(BACKEND_GROUP, name, "backend")


def check_backend(config: Any) -> None:
    """:class:`ConfigError` unless the run's ``backend`` (when set) is installed and, for a built-in one, what its other
    settings say (``--backend torch`` beside ``--scheduler`` cannot work)."""
    if not getattr(config, "backend", None):
        return
    implied = backend_name(replace(config, backend=None))
    if config.backend in BUILT_IN and config.backend != implied:
        raise ConfigError(f"backend {config.backend!r} contradicts the run's settings, which train through {implied!r}: leave "
                          "--backend out (--scheduler, --backend-url and --sampler choose the built-in ones).")
    plugins.entry_point(BACKEND_GROUP, config.backend, "backend")  # installed? (not loaded: nothing is imported yet)


def build_backend(request: BackendRequest) -> Any:
    """The backend of ``request.config`` (see :func:`backend_name`), built by its plugin's factory."""
    check_backend(request.config)
    return load_backend_factory(backend_name(request.config))(request)
