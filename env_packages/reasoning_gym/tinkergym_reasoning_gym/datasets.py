"""One class per reasoning-gym dataset, made on first use: ``datasets.leg_counting`` is the env of ``tinker/rg.leg_counting-v0``.

Entry points name a module attribute (``tinkergym_reasoning_gym.datasets:leg_counting``); this module makes
that attribute when it is first asked for (PEP 562), as a subclass of
:class:`~tinkergym_reasoning_gym.env.ReasoningGymEnv` for that dataset whose docstring lists the dataset's
config fields. Nothing is typed per dataset here: the names are reasoning-gym's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tinkergym_reasoning_gym.env import ReasoningGymEnv


def _doc(name: str, dataset_cls: type, config_cls: type) -> str:
    own = (dataset_cls.__dict__.get("__doc__") or "").strip().split("\n")[0]
    fields = []
    for f in dataclasses.fields(config_cls):
        if f.default is not dataclasses.MISSING:
            shown = f"default {f.default!r}"
        else:
            shown = "required" if f.default_factory is dataclasses.MISSING else "default made fresh"
        fields.append(f"- ``{f.name}`` ({shown})")
    return (
        f"``tinker/rg.{name}-v0``: reasoning-gym's ``{name}`` dataset. {own}\n\n"
        f"Config fields (kwargs; ``seed`` defaults to 0 here):\n\n" + "\n".join(fields) + "\n\n" + (ReasoningGymEnv.__doc__ or "")
    )


def __getattr__(name: str) -> Any:
    if name.startswith("_"):
        raise AttributeError(name)
    import reasoning_gym  # noqa: F401 - registers every dataset
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        raise AttributeError(f"the installed reasoning-gym has no dataset {name!r}")
    dataset_cls, config_cls = DATASETS[name]
    env_cls = type(name, (ReasoningGymEnv,), {"dataset_name": name, "__doc__": _doc(name, dataset_cls, config_cls), "__module__": __name__})
    env_cls.__qualname__ = name
    globals()[name] = env_cls
    return env_cls
