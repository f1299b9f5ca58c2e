"""The env hub: entry-point discovery, registration into Gymnasium and PettingZoo, scaffolding of env packages."""

from tinkergym.registry.discovery import ENTRY_POINT_GROUP, MANIFEST_NAME, PROVIDERS_VARIABLE, EnvSpec
from tinkergym.registry.hub import (
    list_envs,
    load_baseline,
    load_random_agent,
    load_entry_point,
    make,
    make_aec,
    make_checked,
    register_installed_envs,
    spec,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "MANIFEST_NAME",
    "PROVIDERS_VARIABLE",
    "EnvSpec",
    "list_envs",
    "load_baseline",
    "load_random_agent",
    "load_entry_point",
    "make",
    "make_aec",
    "make_checked",
    "register_installed_envs",
    "spec",
]
