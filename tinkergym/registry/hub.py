"""The env hub: registration into Gymnasium/PettingZoo, ``make``, ``make_aec`` and helpful errors.

The hub never replaces an entry it did not make: an installed package that declares an id already in
Gymnasium's (or PettingZoo's) registry, such as ``phys2d/CartPole-v1``, is refused with a warning
naming the package, and the existing env stays as it was.
"""

from __future__ import annotations

import difflib
import importlib
import json
import reprlib
from functools import lru_cache
from importlib import resources
from typing import Any
from collections.abc import Callable

import gymnasium as gym

from tinkergym.errors import ConfigError, DuplicateEnvIdError, EnvKindError, EnvPackageImportError, UnknownEnvError
from tinkergym.registry.discovery import Discovery, EnvSpec, conflict_message, discover, warn_about
from tinkergym.plumbing.install import pip_install

_state: dict[str, Discovery] = {}
#: The entry point the hub registered for each id, so a rescan can tell its own entries from others'.
_registered: dict[str, Any] = {}


def discovery(refresh: bool = False) -> Discovery:
    """The latest scan of installed env packages (``refresh=True`` rescans, e.g. after a pip install)."""
    if refresh or "scan" not in _state:
        found = discover()
        _refuse_taken_ids(found)
        _state["scan"] = found
    return _state["scan"]


def _refuse_taken_ids(found: Discovery) -> None:
    """Move specs whose id another library already registered from ``found.specs`` to ``found.problems``."""
    for env_id, env_spec in list(found.specs.items()):
        registry_name, existing = _existing_entry(env_spec)
        ours = env_id in _registered and existing is not None and existing.entry_point == _registered[env_id]
        if existing is None or ours or existing.entry_point == env_spec.entry_point:
            continue
        del found.specs[env_id]
        suggestion = f"{env_spec.module.split('.')[0]}/{env_id.rsplit('/', 1)[-1]}"
        found.problems.append(
            f"{env_spec.distribution} {env_spec.version}: env id {env_id!r} is already in {registry_name}'s registry "
            f"({existing.entry_point}); tinkergym leaves that env in place and does not register this package's "
            f"{env_spec.entry_point}. Rename the id in the package's entry points, e.g. {suggestion!r}."
        )


def _existing_entry(env_spec: EnvSpec) -> tuple[str, Any]:
    """The registry ``env_spec`` would go into and its current entry for the id (``None`` if free)."""
    if env_spec.kind == "env":
        return "Gymnasium", gym.registry.get(env_spec.id)
    import pettingzoo

    return "PettingZoo", getattr(pettingzoo, "aec_registry", {}).get(env_spec.id)


def list_envs(refresh: bool = False) -> list[EnvSpec]:
    """Every installed env id (metadata only; no env package is imported), sorted by id."""
    return sorted(discovery(refresh).specs.values(), key=lambda s: s.id)


def register_installed_envs(refresh: bool = False) -> Discovery:
    """Register installed ids with Gymnasium (single-agent) and PettingZoo (multi-agent) by entry-point string."""
    found = discovery(refresh)
    _refuse_taken_ids(found)  # something may have registered an id since the scan
    warn_about(found)
    for env_spec in found.specs.values():
        if env_spec.kind == "env":
            _register_gymnasium(env_spec)
        else:
            _register_pettingzoo(env_spec)
    return found


def _register_gymnasium(env_spec: EnvSpec) -> None:
    """Register (or re-register, after an upgrade) an id whose registry entry is free or the hub's own."""
    existing = gym.registry.get(env_spec.id)
    if existing is None or existing.entry_point != env_spec.entry_point or existing.max_episode_steps != env_spec.max_episode_steps:
        gym.registry.pop(env_spec.id, None)  # the hub's own entry: replacing it is not "overriding" another's
        gym.register(id=env_spec.id, entry_point=env_spec.entry_point, max_episode_steps=env_spec.max_episode_steps)
    _registered[env_spec.id] = env_spec.entry_point


def _register_pettingzoo(env_spec: EnvSpec) -> None:
    """Register an AEC id into PettingZoo's registry (when it has one: PettingZoo >= 1.27)."""
    import pettingzoo

    register, registry = getattr(pettingzoo, "register", None), getattr(pettingzoo, "aec_registry", None)
    if register is None or registry is None:
        return
    existing = registry.get(env_spec.id)
    if existing is None or existing.entry_point != env_spec.entry_point:
        registry.pop(env_spec.id, None)
        register("aec", env_spec.id, entry_point=env_spec.entry_point)
    _registered[env_spec.id] = env_spec.entry_point


@lru_cache(maxsize=1)
def known_packages() -> dict[str, dict[str, Any]]:
    """The small index of env packages the hub can suggest installing."""
    text = resources.files("tinkergym.registry").joinpath("known_packages.json").read_text(encoding="utf-8")
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


def unknown_env_message(env_id: str) -> str:
    """Say that ``env_id`` is unknown, with close matches and the ``pip install`` that may provide it."""
    installed = [s.id for s in list_envs()]
    providers = {i: dist for dist, entry in known_packages().items() for i in entry["ids"]}
    lines = [f"No installed env package provides {env_id!r}."]
    folded = {i.lower(): i for i in {*installed, *providers}}
    # An id the hub knows is right as typed (its package is missing): no other ids to suggest, and never the typed one.
    matches = [] if env_id in providers else difflib.get_close_matches(env_id.lower(), list(folded), n=4, cutoff=0.6)
    close = [folded[m] for m in matches if folded[m] != env_id][:3]
    if close:
        lines.append("Did you mean: " + ", ".join(close) + "?")
    for candidate in [env_id, *close[:1]]:
        dist = providers.get(candidate)
        if dist and candidate not in installed:
            lines.append(f"{candidate} is provided by {dist}; install it with: {pip_install(dist=dist)}")
            break
    namespace = env_id.split("/", 1)[0] if "/" in env_id else None
    if namespace in {i.split("/", 1)[0] for i in providers} and not any(i.startswith(f"{namespace}/") for i in installed):
        from tinkergym.registry.shadowing import import_check

        # None of a namespace the hub knows is installed: the env packages may be elsewhere, or this is not the package they see.
        lines.append(f"No env package of the {namespace}/ namespace is installed where this Python looks. {import_check()}")
    lines.append("List installed envs with: tinkergym envs list")
    return "\n".join(lines)


def spec(env_id: str) -> EnvSpec:
    """The hub's spec of ``env_id``; raises :class:`UnknownEnvError` or :class:`DuplicateEnvIdError`."""
    found = discovery()
    env_id = env_id.split(":", 1)[1] if env_id.startswith("tinkergym:") else env_id
    if env_id in found.specs:
        return found.specs[env_id]
    if env_id in found.conflicts:
        raise DuplicateEnvIdError(conflict_message(env_id, found.conflicts[env_id]))
    found = discovery(refresh=True)  # a package may have been installed since the last scan
    if env_id in found.specs:
        return found.specs[env_id]
    raise UnknownEnvError(unknown_env_message(env_id))


def load_entry_point(value: str, distribution: str) -> Callable[..., Any]:
    """Import ``module:attr``; a failure names the distribution and says how to repair it."""
    module_name, _, attr = value.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise EnvPackageImportError(
            f"{distribution} is installed but importing {module_name!r} failed: {type(exc).__name__}: {exc}. "
            f"Reinstall it with: pip install --force-reinstall {distribution}"
        ) from exc
    for part in attr.split("."):
        if not hasattr(target, part):
            raise EnvPackageImportError(f"{distribution} declares {value!r} but {module_name} has no attribute {attr!r}.")
        target = getattr(target, part)
    return target


def load_baseline(env_spec: EnvSpec) -> Callable[..., Any] | None:
    """The baseline agent factory the package declares for ``env_spec`` (``None`` if it declares none)."""
    if not env_spec.baseline:
        return None
    return load_entry_point(env_spec.baseline, env_spec.distribution)


def load_random_agent(env_spec: EnvSpec) -> Callable[..., Any] | None:
    """The random (legal-move) agent factory the package declares for ``env_spec`` (``None`` if it declares none)."""
    if not env_spec.random_agent:
        return None
    return load_entry_point(env_spec.random_agent, env_spec.distribution)


def make(env_id: str, **kwargs: Any) -> gym.Env:
    """Make a single-agent env by id, like ``gym.make``, with tinkergym's errors for unknown or broken ids."""
    env_spec = spec(env_id)
    if env_spec.kind != "env":
        raise EnvKindError(f"{env_spec.id} is a multi-agent (AEC) env; make it with: tinkergym.make_aec({env_spec.id!r})")
    load_entry_point(env_spec.entry_point, env_spec.distribution)
    if env_spec.id not in gym.registry:
        _register_gymnasium(env_spec)
    return gym.make(env_spec.id, **kwargs)


def make_aec(env_id: str, **kwargs: Any) -> Any:
    """Make a multi-agent PettingZoo AEC env by id."""
    env_spec = spec(env_id)
    if env_spec.kind != "aec":
        raise EnvKindError(f"{env_spec.id} is a single-agent env; make it with: tinkergym.make({env_spec.id!r})")
    return load_entry_point(env_spec.entry_point, env_spec.distribution)(**kwargs)


def make_checked(env_id: str, kwargs: dict[str, Any], *, multi_agent: bool = False) -> Any:
    """:func:`make` (or :func:`make_aec`) with the errors a bad kwarg causes in any constructor as :class:`ConfigError`.

    For front ends that take kwargs from users (the CLI, a training config): an unknown keyword, a value of
    a type the constructor cannot use, data nested too deeply or a file that cannot be read becomes a
    message naming the env and what to do.
    """
    try:
        return make_aec(env_id, **kwargs) if multi_agent else make(env_id, **kwargs)
    except TypeError as exc:  # an unknown keyword argument, or a value of a type the constructor cannot use
        raise ConfigError(f"{env_id}: {exc}. See the accepted kwargs with: tinkergym envs info {env_id}") from exc
    except RecursionError as exc:  # e.g. a data file nested deeper than Python's parsers go
        given = ", ".join(f"{key}={reprlib.repr(value)}" for key, value in kwargs.items())
        raise ConfigError(f"{env_id}: {given} is nested too deeply to read (or names a file that is); flatten it.") from exc
    except OSError as exc:  # a file a kwarg names: a name too long, no permission
        raise ConfigError(f"{env_id}: cannot read {exc.filename or 'a file its kwargs name'}: {exc.strerror or exc}.") from exc
