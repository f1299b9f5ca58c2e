"""Discover installed env packages from their metadata, without importing them.

An env package declares each env id under the entry-point group ``tinkergym.envs``
(``"tinker/Gomoku-v0" = "tinkergym_gomoku.env:GomokuEnv"``) and describes it in a static manifest,
``tinkergym_envs.toml``, that sits in its top-level import package. Both are read here with the
standard library (``importlib.metadata``, ``importlib.util.find_spec``, ``tomllib``): finding a
package's folder does not execute it, so listing ids never imports an env package.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import re
import sys
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tinkergym.errors import TinkergymWarning

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENTRY_POINT_GROUP = "tinkergym.envs"
MANIFEST_NAME = "tinkergym_envs.toml"
ENV_ID_PATTERN = re.compile(r"^(?:(?P<namespace>[\w:.-]+)/)?(?P<name>[\w:.-]+?)(?:-v(?P<version>\d+))?$")
_ENTRY_POINT_VALUE = re.compile(r"^[\w.]+:[\w.]+$")
_KINDS = ("env", "aec")


@dataclass(frozen=True)
class EnvSpec:
    """What the hub knows about one installed env id, read from package metadata only."""

    id: str
    entry_point: str
    distribution: str
    version: str
    kind: str = "env"
    data: str = "?"
    turns: str = "?"
    agents: int = 1
    summary: str = ""
    baseline: str | None = None
    max_episode_steps: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def module(self) -> str:
        """The module the entry point names (imported only when the env is made)."""
        return self.entry_point.split(":", 1)[0]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serializable copy."""
        return asdict(self)


@dataclass
class Discovery:
    """The result of one scan: usable specs, ids claimed by several distributions, and problems found."""

    specs: dict[str, EnvSpec] = field(default_factory=dict)
    conflicts: dict[str, list[EnvSpec]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def _manifest_for(module: str) -> tuple[dict[str, Any], str | None]:
    """Read the manifest beside ``module``'s top-level package; ``(data, problem)``."""
    top = module.split(".", 1)[0]
    try:
        found = importlib.util.find_spec(top)
    except (ImportError, ValueError) as exc:
        return {}, f"cannot locate module {top!r}: {exc}"
    if found is None:
        return {}, f"module {top!r} is not importable (is the package installed in this environment?)"
    locations = list(found.submodule_search_locations or [])
    if not locations and found.origin:
        locations = [str(Path(found.origin).parent)]
    for folder in locations:
        path = Path(folder) / MANIFEST_NAME
        if path.is_file():
            try:
                return tomllib.loads(path.read_text(encoding="utf-8")), None
            except (OSError, tomllib.TOMLDecodeError) as exc:
                return {}, f"{path} is not valid TOML: {exc}"
    return {}, None


def _spec_from(env_id: str, value: str, dist: md.Distribution, manifest: dict[str, Any]) -> EnvSpec:
    """Build a spec from an entry point and its manifest table (missing fields keep their defaults)."""
    table = dict(manifest.get(env_id, {}))
    kind = table.pop("kind", "env")
    if kind not in _KINDS:
        raise ValueError(f"kind = {kind!r} for {env_id!r}; use one of {_KINDS}")
    known = {k: table.pop(k) for k in ("data", "turns", "agents", "summary", "baseline", "max_episode_steps") if k in table}
    return EnvSpec(
        id=env_id,
        entry_point=value,
        distribution=dist.metadata["Name"],
        version=dist.version,
        kind=kind,
        extra=table,
        **known,
    )


def discover() -> Discovery:
    """Scan installed distributions for env ids (reads metadata and manifests; imports nothing)."""
    importlib.invalidate_caches()
    found = Discovery()
    claims: dict[str, list[EnvSpec]] = {}
    manifests: dict[str, tuple[dict[str, Any], str | None]] = {}
    seen_dists: set[str] = set()
    for dist in md.distributions():
        name = dist.metadata["Name"] or "?"
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen_dists:  # the same distribution visible twice on sys.path: the first one wins
            continue
        seen_dists.add(key)
        for ep in dist.entry_points.select(group=ENTRY_POINT_GROUP):
            where = f"{name} {dist.version}"
            if not ENV_ID_PATTERN.match(ep.name) or not _ENTRY_POINT_VALUE.match(ep.value.strip()):
                found.problems.append(f"{where}: entry point {ep.name!r} = {ep.value!r} is malformed; expected 'ns/Name-vN' = 'module:Class'")
                continue
            module = ep.value.split(":", 1)[0]
            if module not in manifests:
                manifests[module] = _manifest_for(module)
            manifest, problem = manifests[module]
            if problem and f"{where}: {problem}" not in found.problems:
                found.problems.append(f"{where}: {problem}")
            try:
                claims.setdefault(ep.name, []).append(_spec_from(ep.name, ep.value.strip(), dist, manifest))
            except (TypeError, ValueError) as exc:
                found.problems.append(f"{where}: manifest entry for {ep.name!r} is invalid: {exc}")
    for env_id, specs in sorted(claims.items()):
        if len(specs) == 1:
            found.specs[env_id] = specs[0]
        else:
            found.conflicts[env_id] = specs
    return found


def warn_about(found: Discovery) -> None:
    """Emit one warning per problem and per conflicting id; the rest of the hub keeps working."""
    for problem in found.problems:
        warnings.warn(f"tinkergym: skipping part of an env package: {problem}", TinkergymWarning, stacklevel=3)
    for env_id, specs in found.conflicts.items():
        warnings.warn(conflict_message(env_id, specs), TinkergymWarning, stacklevel=3)


def conflict_message(env_id: str, specs: list[EnvSpec]) -> str:
    """Say which distributions claim ``env_id`` and how to resolve it."""
    names = " and ".join(f"{s.distribution} {s.version} ({s.entry_point})" for s in specs)
    return (
        f"env id {env_id!r} is declared by {names}; it is left unregistered. "
        f"Uninstall all but one of them, e.g.: pip uninstall {specs[-1].distribution}"
    )
