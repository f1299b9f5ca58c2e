"""Discover installed env packages from their metadata, without importing them.

An env package declares each env id under the entry-point group ``tinkergym.envs``
(``"tinker/Gomoku-v0" = "tinkergym_gomoku.env:GomokuEnv"``) and describes it in a static manifest,
``tinkergym_envs.toml``, that sits in its top-level import package. Both are read here with the
standard library (``importlib.metadata``, ``importlib.util.find_spec``, ``tomllib``): finding a
package's folder does not execute it, so listing ids never imports an env package.

A broken package never breaks the scan: unreadable metadata, a manifest that is not UTF-8 or not
TOML, a value of the wrong type, an id without a namespace (``Foo-v0`` would shadow Gymnasium's own
envs) each become a problem that names the package, and the package's other ids and every other
package are still found. When several distributions declare one id, none is used unless the user
chooses one with :data:`PROVIDERS_VARIABLE`.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
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
#: Environment variable that chooses the provider of ids several distributions declare:
#: ``"ns/Name-v0=some-dist,ns/Other-v1=other-dist"``.
PROVIDERS_VARIABLE = "TINKERGYM_ENV_PROVIDERS"
_ENTRY_POINT_VALUE = re.compile(r"^[\w.]+:[\w.]+$")
_KINDS = ("env", "aec")
#: Manifest fields: the type each must have and how to say it.
_FIELDS: dict[str, tuple[type, str]] = {
    "kind": (str, f"one of {_KINDS}"),
    "data": (str, "text"),
    "turns": (str, "text"),
    "summary": (str, "text"),
    "agents": (int, "a whole number of at least 1"),
    "baseline": (str, "an entry point 'module:attr'"),
    "random_agent": (str, "an entry point 'module:attr'"),
    "max_episode_steps": (int, "a whole number of at least 1"),
}
#: Keys a package author may expect in a manifest that tinkergym takes from elsewhere.
_NOT_FIELDS = {
    "id": "the id is the entry point's name (group tinkergym.envs)",
    "entry_point": "the entry point is declared in the package's entry points (group tinkergym.envs)",
    "kwargs": "default arguments belong in the env class's __init__",
    "distribution": "it is read from the package metadata",
    "version": "it is read from the package metadata",
}


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
    random_agent: str | None = None
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
    except Exception as exc:  # noqa: BLE001 - a half-installed package can fail here in many ways; it is one package's problem
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
            except UnicodeDecodeError as exc:
                return {}, f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
            except (OSError, tomllib.TOMLDecodeError) as exc:
                return {}, f"{path} is not valid TOML: {exc}"
    return {}, None


def _spec_from(env_id: str, value: str, name: str, version: str, manifest: dict[str, Any]) -> EnvSpec:
    """Build a spec from an entry point and its manifest table (missing fields keep their defaults).

    Raises:
        ValueError: the table is not a table, or a field has the wrong type or value (the message says which).
    """
    table = manifest.get(env_id, {})
    if not isinstance(table, dict):
        raise ValueError(f"[{env_id!r}] must be a table of fields, got {_toml_type(table)} {_shown(table)}")
    known: dict[str, Any] = {}
    for key, value_in_table in table.items():
        if key in _NOT_FIELDS:
            raise ValueError(f"{key!r} is not a manifest field: {_NOT_FIELDS[key]}")
        if key in _FIELDS:
            _check_field(key, value_in_table)
            known[key] = value_in_table
    extra = {k: v for k, v in table.items() if k not in known}
    return EnvSpec(id=env_id, entry_point=value, distribution=name, version=version, extra=extra, **known)


def _check_field(key: str, value: Any) -> None:
    expected, described = _FIELDS[key]
    ok = isinstance(value, expected) and not isinstance(value, bool)
    if ok and key == "kind":
        ok = value in _KINDS
    elif ok and expected is int:
        ok = value >= 1
    elif ok and key in ("baseline", "random_agent"):
        ok = bool(_ENTRY_POINT_VALUE.match(value.strip()))
    if not ok:
        raise ValueError(f"{key} = {_shown(value)} ({_toml_type(value)}); it must be {described}")


def _toml_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array", dict: "a table"}
    return names.get(type(value), f"a {type(value).__name__}")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _id_problem(env_id: str, value: str, module_hint: str) -> str | None:
    """What is wrong with an entry point ``env_id = value``, or ``None``."""
    match = ENV_ID_PATTERN.match(env_id)
    if not match or ":" in env_id or not _ENTRY_POINT_VALUE.match(value.strip()):
        return f"entry point {env_id!r} = {value!r} is malformed; expected 'ns/Name-vN' = 'module:Class'"
    if not match.group("namespace"):
        return (
            f"env id {env_id!r} has no namespace, so it could replace one of Gymnasium's own envs; it is not registered. "
            f"Declare it as 'ns/Name-vN', e.g. '{module_hint}/{env_id}'"
        )
    return None


def discover() -> Discovery:
    """Scan installed distributions for env ids (reads metadata and manifests; imports nothing)."""
    importlib.invalidate_caches()
    found = Discovery()
    claims: dict[str, list[EnvSpec]] = {}
    manifests: dict[str, tuple[dict[str, Any], str | None]] = {}
    seen_dists: set[str] = set()
    for dist in md.distributions():
        try:  # metadata a broken install left behind (not UTF-8, say) is that package's problem only
            entry_points = list(dist.entry_points.select(group=ENTRY_POINT_GROUP))
            # A distribution that declares no env is only counted by name, for the rule below: its folder's name
            # (importlib's own key for a PathDistribution) spares parsing its METADATA, most of a listing's time.
            folder_name = getattr(dist, "_normalized_name", None)
            if not entry_points and isinstance(folder_name, str) and folder_name:
                seen_dists.add(_normalized(folder_name))
                continue
            name, version = dist.metadata["Name"] or "?", dist.version or "?"
        except Exception as exc:  # noqa: BLE001 - broken metadata is one distribution's problem, reported below
            if _may_declare_envs(dist):
                found.problems.append(f"the distribution at {getattr(dist, '_path', '?')}: cannot read its metadata ({type(exc).__name__}: {exc})")
            continue
        key = _normalized(name)
        if key in seen_dists:  # the same distribution visible twice on sys.path: the first one wins
            continue
        seen_dists.add(key)
        for ep in entry_points:
            where = f"{name} {version}"
            module = ep.value.split(":", 1)[0].strip()
            problem = _id_problem(ep.name, ep.value, module.split(".", 1)[0])
            if problem:
                found.problems.append(f"{where}: {problem}")
                continue
            if module not in manifests:
                manifests[module] = _manifest_for(module)
            manifest, problem = manifests[module]
            if problem and f"{where}: {problem}" not in found.problems:
                found.problems.append(f"{where}: {problem}")
            try:
                env_spec = _spec_from(ep.name, ep.value.strip(), name, version, manifest)
            except ValueError as exc:
                found.problems.append(f"{where}: the manifest entry for {ep.name!r} is invalid, so it is not registered: {exc}")
                continue
            claims.setdefault(ep.name, []).append(env_spec)
    _settle_claims(claims, found)
    return found


def _may_declare_envs(dist: md.Distribution) -> bool:
    """Whether a distribution whose metadata cannot be read might declare env ids (``False``: surely not)."""
    folder = getattr(dist, "_path", None)  # PathDistribution's folder; other kinds cannot be checked
    try:
        return folder is None or ENTRY_POINT_GROUP.encode() in (Path(folder) / "entry_points.txt").read_bytes()
    except OSError:
        return False


def _normalized(distribution: str) -> str:
    """A distribution name in its canonical form (PEP 503): ``Tinkergym_Foo`` -> ``tinkergym-foo``."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def chosen_providers() -> dict[str, str]:
    """The distribution chosen for each id in :data:`PROVIDERS_VARIABLE` (canonical names)."""
    chosen = {}
    for item in os.environ.get(PROVIDERS_VARIABLE, "").split(","):
        env_id, _, distribution = item.strip().rpartition("=")
        if env_id and distribution:
            chosen[env_id.strip()] = _normalized(distribution.strip())
    return chosen


def _settle_claims(claims: dict[str, list[EnvSpec]], found: Discovery) -> None:
    """One claim per id is a spec; several are a conflict unless the user chose one of them."""
    chosen = chosen_providers()
    for env_id, specs in sorted(claims.items()):
        picked = [s for s in specs if _normalized(s.distribution) == chosen.get(env_id)]
        if len(specs) == 1 or len(picked) == 1:
            found.specs[env_id] = specs[0] if len(specs) == 1 else picked[0]
        else:
            found.conflicts[env_id] = specs


def warn_about(found: Discovery) -> None:
    """Emit one warning per problem and per conflicting id; the rest of the hub keeps working."""
    for problem in found.problems:
        warnings.warn(f"tinkergym: skipping part of an env package: {problem}", TinkergymWarning, stacklevel=3)
    for env_id, specs in found.conflicts.items():
        warnings.warn(conflict_message(env_id, specs), TinkergymWarning, stacklevel=3)


def conflict_message(env_id: str, specs: list[EnvSpec]) -> str:
    """Say which distributions claim ``env_id``, that none is used, and how to choose one."""
    names = " and ".join(f"{s.distribution} {s.version} ({s.entry_point})" for s in specs)
    choices = " or ".join(f"{PROVIDERS_VARIABLE}='{env_id}={s.distribution}'" for s in specs)
    chosen = chosen_providers().get(env_id)
    note = f" {PROVIDERS_VARIABLE} chooses {chosen!r} for it, which does not declare it." if chosen else ""
    return (
        f"env id {env_id!r} is declared by {len(specs)} packages, {names}; tinkergym registers none of them "
        f"rather than guess.{note} To use one, choose it with the environment variable {choices} "
        f"(several choices separated by commas), set before importing tinkergym or followed by "
        f"tinkergym.register_installed_envs(refresh=True)."
    )
